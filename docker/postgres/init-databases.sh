#!/usr/bin/env bash
# Creates the `airflow` and `mlflow` roles and databases. The postgres image runs files in
# /docker-entrypoint-initdb.d once, on the first start with an empty data volume; a shell script rather than
# plain SQL so the passwords come from the environment (docker/.env) instead of being written in a file.
set -euo pipefail

: "${AIRFLOW_DB_PASSWORD:?set AIRFLOW_DB_PASSWORD}"
: "${MLFLOW_DB_PASSWORD:?set MLFLOW_DB_PASSWORD}"

# psql substitutes :'name' with the variable's value as a quoted SQL literal (quotes inside are escaped).
psql -v ON_ERROR_STOP=1 --username "${POSTGRES_USER}" --dbname "${POSTGRES_DB:-${POSTGRES_USER}}" \
  -v airflow_password="${AIRFLOW_DB_PASSWORD}" -v mlflow_password="${MLFLOW_DB_PASSWORD}" <<'SQL'
CREATE ROLE airflow LOGIN PASSWORD :'airflow_password';
CREATE DATABASE airflow OWNER airflow ENCODING 'UTF8';
CREATE ROLE mlflow LOGIN PASSWORD :'mlflow_password';
CREATE DATABASE mlflow OWNER mlflow ENCODING 'UTF8';
SQL
