#!/usr/bin/env bash
# PostgreSQL of the local stack (docker/services.Dockerfile): the official postgres image's first-start
# behaviour in a few lines. On an empty data folder: initdb (password auth over TCP), then the `airflow` and
# `mlflow` roles and databases (init-databases.sh); then the server in the foreground on PGPORT.
#   PGDATA (default /var/lib/postgresql/data), PGPORT (default 5432), POSTGRES_PASSWORD,
#   AIRFLOW_DB_PASSWORD, MLFLOW_DB_PASSWORD; runs as root only to fix the volume's owner, then as postgres.
set -euo pipefail
export PGDATA=${PGDATA:-/var/lib/postgresql/data} PGPORT=${PGPORT:-5432}
: "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}"

if [ "$(id -u)" = 0 ]; then
  mkdir -p "$PGDATA" /run/postgresql
  chown -R postgres:postgres "$PGDATA" /run/postgresql
  chmod 0700 "$PGDATA"
  exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" "$@"
fi

if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp)
  printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
  initdb -D "$PGDATA" -U postgres --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 \
    --encoding=UTF8 --locale=C.UTF-8 >/dev/null
  rm -f "$pwfile"
  # Listen on loopback only: the stack runs with host networking.
  pg_ctl -D "$PGDATA" -o "-c listen_addresses='' -p $PGPORT" -w start >/dev/null
  POSTGRES_USER=postgres POSTGRES_DB=postgres PGHOST=/run/postgresql bash /usr/local/bin/init-databases.sh
  pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
fi
exec postgres -D "$PGDATA" -c listen_addresses=127.0.0.1 -c port="$PGPORT" -c unix_socket_directories=/run/postgresql
