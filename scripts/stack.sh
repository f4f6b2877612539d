#!/usr/bin/env bash
# The whole platform in containers on this machine, with podman: PostgreSQL, Redis (Celery broker), moto S3,
# MLflow, Airflow (api-server, scheduler, dag-processor, triggerer, a Celery worker) on the torch-free Airflow
# image, and a Ray head and a CPU Ray worker on the CPU worker image. Every task that loads torch, a tokenizer or a
# model (train, prepare_data, evaluate_checkpoint, register_model) is a Ray job: no Airflow worker needs torch.
#
#   bash scripts/stack.sh build     # the four images, tagged with a digest of their inputs (reused when equal)
#   bash scripts/stack.sh up        # build, then start every container and wait until each one is ready
#   bash scripts/stack.sh status    # containers, their state, and the URLs
#   bash scripts/stack.sh trigger [CONF_JSON]   # one rlhf_ppo run through the Airflow REST API, waits for it
#   bash scripts/stack.sh down      # stop and remove the stack's containers and volumes (nothing else); their
#                                   # logs stay in .rlhf/<stack>/logs/
#
# Every container uses host networking on 127.0.0.1 (podman here cannot set up bridge networks) and a fixed
# port range, RLHF_STACK_PORT_BASE (default 28700) to +99, which `up` checks is free first. State (generated
# secrets, ports) lives in .rlhf/rlhf-stack/. docs/deployment.md ("Deployment on this machine") explains it all.
#
#   RLHF_STACK_BASE_IMAGE  base of every image (default local/debian:bookworm, from docker/podman-setup.sh)
#   RLHF_STACK_PORT_BASE   first port of the range (default 28700)
#   RLHF_STACK_TIMEOUT_S   seconds `up` waits for one container to become ready (default 300)
#   RLHF_STACK_NAME        prefix of container and volume names, and the label value (default rlhf-stack)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

BASE_IMAGE=${RLHF_STACK_BASE_IMAGE:-local/debian:bookworm}
PORT_BASE=${RLHF_STACK_PORT_BASE:-28700}
TIMEOUT_S=${RLHF_STACK_TIMEOUT_S:-300}
STACK=${RLHF_STACK_NAME:-rlhf-stack}
LABEL=rlhf-ops.stack=$STACK
STATE=$ROOT/.rlhf/$STACK

# Fixed offsets inside the range: nothing here picks a random port (the test suite does, below 28700).
P_POSTGRES=$((PORT_BASE + 10)) P_REDIS=$((PORT_BASE + 11)) P_S3=$((PORT_BASE + 12)) P_MLFLOW=$((PORT_BASE + 13))
P_RAY_GCS=$((PORT_BASE + 20)) P_RAY_DASH=$((PORT_BASE + 21)) P_RAY_CLIENT=$((PORT_BASE + 22))
P_AIRFLOW=$((PORT_BASE + 80)) P_SCHED_HEALTH=$((PORT_BASE + 81)) P_WORKER_LOGS=$((PORT_BASE + 82))
P_TRIGGER_LOGS=$((PORT_BASE + 83))
# Ray ports of the head (+30..+35, its worker processes +40..+54) and of the CPU worker node (+60..+65, +66..+79).
ray_node_ports() {  # $1 = first port of the node's block, $2 = first worker port
  local b=$1
  echo "--node-ip-address=127.0.0.1 --node-manager-port=$b --object-manager-port=$((b + 1))" \
    "--runtime-env-agent-port=$((b + 2)) --dashboard-agent-grpc-port=$((b + 3))" \
    "--dashboard-agent-listen-port=$((b + 4)) --metrics-export-port=$((b + 5))" \
    "--min-worker-port=$2 --max-worker-port=$(($2 + 14))"
}
ALL_PORTS=("$P_POSTGRES" "$P_REDIS" "$P_S3" "$P_MLFLOW" "$P_RAY_GCS" "$P_RAY_DASH" "$P_RAY_CLIENT" "$P_AIRFLOW"
  "$P_SCHED_HEALTH" "$P_WORKER_LOGS" "$P_TRIGGER_LOGS")

die() { echo "stack: $*" >&2; exit 1; }
log() { echo "stack: $*" >&2; }

need_podman() {
  command -v podman >/dev/null 2>&1 || die "podman is not installed: run bash docker/podman-setup.sh (as root)"
}

need_base() {
  podman image exists "$BASE_IMAGE" \
    || die "base image $BASE_IMAGE not found: run bash docker/podman-setup.sh, or set RLHF_STACK_BASE_IMAGE"
}

# ------------------------------------------------------------------------------------------------ build
# image name -> Dockerfile, and the context paths it copies (its .dockerignore's ! lines): the input digest.
declare -A DOCKERFILE=([services]=docker/services.Dockerfile [mlflow]=docker/mlflow.Dockerfile
  [airflow]=docker/airflow.Dockerfile [worker-cpu]=docker/worker-cpu.Dockerfile)
BUILD_ORDER=(services mlflow airflow worker-cpu)

# Each image is tagged with the digest of its inputs (rlhf-ops/NAME:DIGEST), the tag the containers run, and
# rlhf-ops/NAME:local points at the newest build. `build` fills REF; `up` starts containers from it.
declare -A REF=()
image_ref() { echo "${REF[$1]:?image $1 not built in this run}"; }

# Digest of everything an image is built from: its Dockerfile and ignore file, the files the ignore file lets
# into the context, the base image's id and the build arguments. Equal digest = the image is reused as is.
inputs_digest() {
  local name=$1 df=${DOCKERFILE[$1]} paths=()
  mapfile -t paths < <(sed -n 's#^!\(.*\)$#\1#p' "$df.dockerignore" | sed 's#/$##')
  # Globs (docker/build-context/wheels/rlhf_ops-*.whl) name the files they match.
  local p g expanded=()
  for p in "${paths[@]}"; do for g in $p; do expanded+=("$g"); done; done
  paths=("${expanded[@]}")
  {
    echo "base $(podman image inspect --format '{{.Id}}' "$BASE_IMAGE")"
    echo "args $(build_args "$name" | tr '\n' ' ')"
    cat "$df" "$df.dockerignore"
    if [ ${#paths[@]} -gt 0 ]; then
      find "${paths[@]}" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' ! -path '*/.*_cache/*' 2>/dev/null \
        | LC_ALL=C sort | while read -r f; do
          # Large wheels (torch) by name and size: hashing 200 MB on every `up` would cost seconds for nothing. The
          # project's own wheels are small and hashed: their bytes change with any source change.
          case "$f" in
            *.whl) if [ "$(stat -c %s "$f")" -gt 20000000 ]; then echo "$f $(stat -c %s "$f")"; else sha256sum "$f"; fi ;;
            *) sha256sum "$f" ;;
          esac
        done
    fi
  } | sha256sum | cut -c1-16
}

build_args() {
  echo "BASE_IMAGE=$BASE_IMAGE"
}

# The build context's wheels: the two distributions of this repository (scripts/build_wheels.py, reproducible: the
# same sources give the same bytes) and the machine's CPU torch wheel. The images install them with
# -c constraints/ci.txt (the set CI ran), the Airflow image also with constraints/stack.txt.
prepare_context() {
  local wheels=docker/build-context/wheels py=${RLHF_STACK_PYTHON:-python3}
  [ -z "${RLHF_STACK_PYTHON:-}" ] && [ -x .venv/bin/python ] && py=.venv/bin/python
  "$py" scripts/build_wheels.py "$wheels" >/dev/null \
    || die "building the wheels failed: $py scripts/build_wheels.py $wheels (needs pip, setuptools and wheel)"
  if ! compgen -G "$wheels/torch-*+cpu-*.whl" >/dev/null; then
    # pip's configuration here points at the machine's local wheel folder, which holds the CPU build.
    "$py" -m pip download -q --no-deps --only-binary=:all: -d "$wheels" "torch==2.13.0" >/dev/null 2>&1 || true
    if ! compgen -G "$wheels/torch-*+cpu-*.whl" >/dev/null; then
      rm -f "$wheels"/torch-*.whl
      log "no local CPU torch wheel found; the worker image takes torch from PyTorch's CPU index"
    fi
  fi
}

build_one() {
  local name=$1 ref digest args=() start previous
  digest=$(inputs_digest "$name")
  ref=rlhf-ops/$name:$digest
  REF[$name]=$ref
  if podman image exists "$ref"; then
    podman tag "$ref" "rlhf-ops/$name:local"
    log "image $ref is up to date (its inputs did not change)"
    return 0
  fi
  while read -r a; do args+=(--build-arg "$a"); done < <(build_args "$name")
  previous=$(podman image inspect --format '{{.Id}}' "rlhf-ops/$name:local" 2>/dev/null || true)
  start=$(date +%s)
  log "building $ref (inputs $digest; log in $STATE/build-$name.log)"
  mkdir -p "$STATE"
  if ! podman build --format docker --network host --layers "${BUILD_MOUNTS[@]}" \
      -f "${DOCKERFILE[$name]}" --ignorefile "${DOCKERFILE[$name]}.dockerignore" "${args[@]}" --build-arg "RLHF_OPS_GIT_COMMIT=$(git rev-parse HEAD 2>/dev/null || true)" \
      --label "rlhf-ops.inputs=$digest" -t "$ref" -t "rlhf-ops/$name:local" . >"$STATE/build-$name.log" 2>&1; then
    die "building $ref failed: $(grep -v '^\s*$' "$STATE/build-$name.log" | tail -1); full log: $STATE/build-$name.log"
  fi
  # (A build stopped by a signal may exit 0 without an image.)
  podman image exists "$ref" || die "building $ref stopped without an image; full log: $STATE/build-$name.log"
  log "built $ref in $(($(date +%s) - start)) s, $(podman image inspect --format '{{.Size}}' "$ref" \
    | awk '{printf "%.0f MB", $1 / 1e6}')"
  prune_old "$name" "$digest" "$previous"
}

# Earlier builds of one image (other digest tags, and the image `:local` pointed at before this build): untagged,
# so podman deletes them unless a container still runs one (then rmi fails and it stays until the next build).
# Only rlhf-ops/NAME images, never anything else.
prune_old() {
  local name=$1 keep=$2 previous=${3:-} tag
  while read -r tag; do
    case "$tag" in "$keep" | local | "<none>" | "") continue ;; esac
    podman rmi "rlhf-ops/$name:$tag" >/dev/null 2>&1 || true
  done < <(podman images --filter "reference=rlhf-ops/$name" --format '{{.Tag}}' 2>/dev/null)
  if [ -n "$previous" ] && [ "$(podman image inspect --format '{{len .RepoTags}}' "$previous" 2>/dev/null)" = 0 ]; then
    podman rmi "$previous" >/dev/null 2>&1 || true
  fi
}

# Build-time only (not in the images): this machine reaches PyPI through a TLS-intercepting proxy whose CA is in
# the host's bundle, not in Debian's; pip inside the build gets the host bundle through /etc/pip.conf.
BUILD_MOUNTS=()
build_mounts() {
  local bundle=${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}
  [ -f "$bundle" ] || return 0
  mkdir -p "$STATE"
  printf '[global]\ncert = /etc/ssl/certs/rlhf-host-ca.crt\n' >"$STATE/pip.conf"
  BUILD_MOUNTS=(-v "$bundle:/etc/ssl/certs/rlhf-host-ca.crt:ro" -v "$STATE/pip.conf:/etc/pip.conf:ro")
}

cmd_build() {
  need_podman
  need_base
  prepare_context
  build_mounts
  local name
  for name in "${@:-${BUILD_ORDER[@]}}"; do
    [ -n "${DOCKERFILE[$name]:-}" ] || die "unknown image '$name' (one of: ${BUILD_ORDER[*]})"
    build_one "$name"
  done
}

# ------------------------------------------------------------------------------------------------ up
containers() { podman ps -a --filter "label=$LABEL" --format '{{.Names}}' 2>/dev/null; }

check_ports() {
  # Every port of the range, not only the ones in use today: a later version may add a service.
  local busy p
  busy=$(ss -Htln 2>/dev/null | awk '{print $4}' | sed 's/.*://' | sort -un)
  for p in "${ALL_PORTS[@]}" $(seq $((PORT_BASE + 30)) $((PORT_BASE + 79))); do
    if grep -qx "$p" <<<"$busy"; then
      die "port $p (range $PORT_BASE-$((PORT_BASE + 99))) is in use by another process: stop it, or set" \
        "RLHF_STACK_PORT_BASE to another free range"
    fi
  done
}

write_env() {
  # Fresh secrets per stack (the volumes are new too); private files, never on a command line. Hex: a
  # token_urlsafe value starting with "-" (1 in 64) was read as an option by `airflow users create`.
  mkdir -p "$STATE"
  chmod 0700 "$STATE"
  local pg_pw af_pw ml_pw token fernet jwt api admin_pw
  read -r pg_pw af_pw ml_pw token jwt api admin_pw < <(python3 -c \
    "import secrets; print(' '.join(secrets.token_hex(24) for _ in range(7)))")
  fernet=$(python3 -c "import base64, os; print(base64.urlsafe_b64encode(os.urandom(32)).decode())")
  umask 0077
  cat >"$STATE/secrets.env" <<ENV
POSTGRES_PASSWORD=$pg_pw
AIRFLOW_DB_PASSWORD=$af_pw
MLFLOW_DB_PASSWORD=$ml_pw
RAY_AUTH_TOKEN=$token
AIRFLOW_ADMIN_USERNAME=admin
AIRFLOW_ADMIN_PASSWORD=$admin_pw
ENV
  # The driver named in every URL: SQLAlchemy 2.1 reads a PostgreSQL URL without one as psycopg 3, which the
  # image does not install (psycopg2 only); the Celery result backend without it stopped the worker at start-up.
  local db="postgresql+psycopg2://airflow:$af_pw@127.0.0.1:$P_POSTGRES/airflow"
  cat >"$STATE/airflow.env" <<ENV
AIRFLOW__CORE__EXECUTOR=CeleryExecutor
AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=$db
AIRFLOW__CELERY__BROKER_URL=redis://127.0.0.1:$P_REDIS/0
AIRFLOW__CELERY__RESULT_BACKEND=db+$db
AIRFLOW__CORE__FERNET_KEY=$fernet
AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION=true
AIRFLOW__CORE__LOAD_EXAMPLES=false
AIRFLOW__CORE__EXECUTION_API_SERVER_URL=http://127.0.0.1:$P_AIRFLOW/execution/
AIRFLOW__API_AUTH__JWT_SECRET=$jwt
AIRFLOW__API__SECRET_KEY=$api
AIRFLOW__API__HOST=127.0.0.1
AIRFLOW__API__PORT=$P_AIRFLOW
AIRFLOW__API__WORKERS=1
AIRFLOW__API__BASE_URL=http://127.0.0.1:$P_AIRFLOW/
AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK=true
AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_SERVER_PORT=$P_SCHED_HEALTH
AIRFLOW__LOGGING__BASE_LOG_FOLDER=/opt/airflow/logs
AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT=$P_WORKER_LOGS
AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT=$P_TRIGGER_LOGS
AIRFLOW__CORE__DAGS_FOLDER=/opt/airflow/dags
AIRFLOW__CORE__PLUGINS_FOLDER=/opt/airflow/plugins
AIRFLOW__RLHF__RAY_DASHBOARD_URL=http://127.0.0.1:$P_RAY_DASH
MLFLOW_TRACKING_URI=http://127.0.0.1:$P_MLFLOW
MLFLOW_DISABLE_TELEMETRY=true
RLHF_WORK_DIR=/rlhf/work
ENV
  umask 0022
}

# podman run with the stack's common options; $1 = service name, rest = podman options + image + command.
run_c() {
  local name=$1
  shift
  podman run -d --name "$STACK-$name" --label "$LABEL" --network host --restart no "$@" >/dev/null \
    || die "container $STACK-$name did not start (podman run failed; see above)"
}

exited_line() {  # $1 = container; prints one line (exit code, last log line) if it is no longer running
  local c=$1 state code last
  read -r state code < <(podman inspect --format '{{.State.Status}} {{.State.ExitCode}}' "$c" 2>/dev/null \
    || echo "missing 0")
  [ "$state" = running ] && return 0
  last=$(podman logs --tail 40 "$c" 2>&1 | grep -v '^\s*$' | tail -1 | cut -c1-300)
  echo "container $c exited (code $code, state $state): $last; full log: podman logs $c"
}

fail_exited() {  # $1 = container; dies with exited_line's line if it is no longer running
  local line
  line=$(exited_line "$1")
  [ -z "$line" ] || die "$line"
}

wait_ready() {  # $1 = service, $2 = command run on the host until it succeeds
  local c=$STACK-$1 deadline=$((SECONDS + TIMEOUT_S))
  while ! bash -c "$2" >/dev/null 2>&1; do
    fail_exited "$c"
    [ $SECONDS -lt $deadline ] || die "container $c not ready after ${TIMEOUT_S} s (check: $2); podman logs $c"
    sleep 2
  done
  log "$1 ready"
}

cmd_up() {
  need_podman
  need_base
  local existing
  existing=$(containers | paste -sd ' ')
  [ -z "$existing" ] || die "the stack is already up ($existing): bash scripts/stack.sh status, or down first"
  check_ports
  cmd_build
  write_env
  set -a
  # shellcheck disable=SC1091  # written just above by write_env
  . "$STATE/secrets.env"
  set +a
  local v
  for v in postgres airflow-logs work; do
    podman volume create --label "$LABEL" "$STACK-$v" >/dev/null
  done
  # Logs and the work folder are written by Airflow (UID 50000) and Ray (UID 1000), both in group 0.
  podman run --rm --network host -v "$STACK-airflow-logs:/a" -v "$STACK-work:/w" "$(image_ref services)" \
    chmod 2777 /a /w
  local sec=(--env-file "$STATE/secrets.env") af=(--env-file "$STATE/airflow.env")
  local fab=(-e AIRFLOW__CORE__AUTH_MANAGER=airflow.providers.fab.auth_manager.fab_auth_manager.FabAuthManager)
  local logs=(-v "$STACK-airflow-logs:/opt/airflow/logs") work=(-v "$STACK-work:/rlhf/work")

  run_c postgres "${sec[@]}" -e PGPORT="$P_POSTGRES" -v "$STACK-postgres:/var/lib/postgresql/data" \
    "$(image_ref services)" pg-entrypoint.sh
  run_c redis "$(image_ref services)" redis-server --bind 127.0.0.1 --port "$P_REDIS" --save "" --appendonly no
  run_c s3 "$(image_ref services)" moto_server -H 127.0.0.1 -p "$P_S3"
  wait_ready postgres "podman exec $STACK-postgres pg_isready -q -h 127.0.0.1 -p $P_POSTGRES -d mlflow"
  wait_ready redis "podman exec $STACK-redis redis-cli -p $P_REDIS ping | grep -q PONG"
  wait_ready s3 "python3 -c \"import urllib.request as u; u.urlopen('http://127.0.0.1:$P_S3/', timeout=5)\""
  podman exec "$STACK-s3" python -c "import boto3; s3 = boto3.client('s3', endpoint_url='http://127.0.0.1:$P_S3', \
region_name='us-east-1', aws_access_key_id='stack', aws_secret_access_key='stack'); \
[s3.create_bucket(Bucket=b) for b in ('rlhf-checkpoints', 'datasets', 'mlflow')]" \
    || die "could not create the S3 buckets on moto (podman logs $STACK-s3)"

  run_c mlflow -e MLFLOW_BACKEND_STORE_URI="postgresql+psycopg2://mlflow:$MLFLOW_DB_PASSWORD@127.0.0.1:$P_POSTGRES/mlflow" \
    -e MLFLOW_S3_ENDPOINT_URL="http://127.0.0.1:$P_S3" -e AWS_ACCESS_KEY_ID=stack -e AWS_SECRET_ACCESS_KEY=stack \
    -e AWS_DEFAULT_REGION=us-east-1 -e MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false \
    -e MLFLOW_SERVER_ALLOWED_HOSTS="127.0.0.1,127.0.0.1:*,localhost,localhost:*" \
    "$(image_ref mlflow)" mlflow server --host 127.0.0.1 --port "$P_MLFLOW" --workers 1 \
    --artifacts-destination s3://mlflow

  # One-shot: DB migration, admin user, connections (in the foreground: its exit code decides).
  log "airflow-init: migrating the metadata DB (a minute or two)"
  podman run --name "$STACK-airflow-init" --label "$LABEL" --network host "${af[@]}" "${fab[@]}" "${sec[@]}" \
    -e RLHF_RAY_DASHBOARD_HOST=127.0.0.1 -e RLHF_RAY_DASHBOARD_PORT="$P_RAY_DASH" \
    -e RLHF_S3_ENDPOINT_URL="http://127.0.0.1:$P_S3" -e RLHF_S3_ACCESS_KEY_ID=stack \
    -e RLHF_S3_SECRET_ACCESS_KEY=stack -e RLHF_MLFLOW_HOST=127.0.0.1 -e RLHF_MLFLOW_PORT="$P_MLFLOW" \
    "$(image_ref airflow)" bash /opt/rlhf/bin/airflow-init.sh >"$STATE/airflow-init.log" 2>&1 \
    || die "airflow-init failed: $(grep -v '^\s*$' "$STATE/airflow-init.log" | tail -1); log: $STATE/airflow-init.log"
  wait_ready mlflow "python3 -c \"import urllib.request as u; u.urlopen('http://127.0.0.1:$P_MLFLOW/health', timeout=5)\""

  # The Ray nodes' own S3 identity (moto takes any key): a job gets only the endpoint and region from Airflow's
  # aws_default, never its keys (docs/deployment.md, "S3").
  local ray_env=(-e RAY_AUTH_MODE=token -e RAY_AUTH_TOKEN="$RAY_AUTH_TOKEN" -e RLHF_WORK_DIR=/rlhf/work
    -e MLFLOW_TRACKING_URI="http://127.0.0.1:$P_MLFLOW" -e AWS_ACCESS_KEY_ID=stack -e AWS_SECRET_ACCESS_KEY=stack
    --shm-size=1g)
  run_c ray-head "${ray_env[@]}" "${work[@]}" -e RAY_NODE_TYPE=head -e RAY_NUM_GPUS=0 \
    -e RAY_GCS_PORT="$P_RAY_GCS" -e RAY_DASHBOARD_PORT="$P_RAY_DASH" \
    -e RAY_START_ARGS="$(ray_node_ports $((PORT_BASE + 30)) $((PORT_BASE + 40))) --num-cpus=2 \
--dashboard-host=127.0.0.1 --ray-client-server-port=$P_RAY_CLIENT --object-store-memory=300000000" \
    "$(image_ref worker-cpu)"
  run_c airflow-api-server "${af[@]}" "${fab[@]}" "${logs[@]}" "$(image_ref airflow)" api-server
  run_c airflow-scheduler "${af[@]}" "${fab[@]}" "${logs[@]}" "$(image_ref airflow)" scheduler
  run_c airflow-dag-processor "${af[@]}" "${fab[@]}" "${logs[@]}" "$(image_ref airflow)" dag-processor
  run_c airflow-triggerer "${af[@]}" "${fab[@]}" "${logs[@]}" "$(image_ref airflow)" triggerer
  # Every task in the torch-free Airflow image: the heavy ones submit Ray jobs and read their results from the
  # shared work folder (/rlhf/work/jobs/...).
  run_c airflow-worker "${af[@]}" "${fab[@]}" "${logs[@]}" "${work[@]}" "$(image_ref airflow)" \
    airflow celery worker --queues default --concurrency 4 --celery-hostname "default@%h" --skip-serve-logs
  local ray_curl="curl -fs -H 'Authorization: Bearer $RAY_AUTH_TOKEN' http://127.0.0.1:$P_RAY_DASH"
  wait_ready ray-head "$ray_curl/api/version"
  run_c ray-worker "${ray_env[@]}" "${work[@]}" -e RAY_NODE_TYPE=worker -e RAY_HEAD_ADDRESS="127.0.0.1:$P_RAY_GCS" \
    -e RAY_START_ARGS="$(ray_node_ports $((PORT_BASE + 60)) $((PORT_BASE + 66))) --num-cpus=2 \
--object-store-memory=300000000" "$(image_ref worker-cpu)"
  wait_ready airflow-api-server "curl -fs http://127.0.0.1:$P_AIRFLOW/api/v2/monitor/health"
  wait_ready airflow-scheduler "curl -fs http://127.0.0.1:$P_SCHED_HEALTH/health"
  wait_ready airflow-worker "podman logs $STACK-airflow-worker 2>&1 | grep -q 'ready\.'"
  # Both nodes in `ray status`'s Active list.
  wait_ready ray-worker "[ \$(podman exec $STACK-ray-head ray status 2>/dev/null | sed -n '/Active:/,/Pending:/p' \
| grep -c node_) -ge 2 ]"
  wait_ready airflow-dag-processor "python3 docker/stack_client.py --state $STATE dag-ready rlhf_ppo"
  wait_ready airflow-triggerer "podman exec $STACK-airflow-triggerer airflow jobs check --job-type TriggererJob --local"
  cmd_status
}

# ------------------------------------------------------------------------------------------------ status / down
cmd_status() {
  need_podman
  local names
  names=$(containers)
  if [ -z "$names" ]; then
    echo "stack: not running (bash scripts/stack.sh up)"
    return 0
  fi
  podman ps -a --filter "label=$LABEL" --format 'table {{.Names}}\t{{.Status}}\t{{.Image}}'
  cat <<TXT
Airflow   http://127.0.0.1:$P_AIRFLOW   (user admin, password in $STATE/secrets.env)
MLflow    http://127.0.0.1:$P_MLFLOW
Ray       http://127.0.0.1:$P_RAY_DASH   (token: RAY_AUTH_TOKEN in $STATE/secrets.env)
S3 (moto) http://127.0.0.1:$P_S3   buckets rlhf-checkpoints, datasets, mlflow (any key id / secret)
TXT
  # A service container that stopped: one line each (the one-shot airflow-init ends with code 0 by design).
  local c line bad=0
  for c in $names; do
    [ "$c" = "$STACK-airflow-init" ] && [ "$(podman inspect --format '{{.State.ExitCode}}' "$c")" = 0 ] && continue
    line=$(exited_line "$c")
    [ -z "$line" ] || { log "$line"; bad=1; }
  done
  return $bad
}

cmd_down() {
  need_podman
  local names vols
  names=$(containers)
  # Only what carries the stack's label: other containers and volumes on this machine are never touched.
  if [ -n "$names" ]; then
    # Their logs outlive them (a failed `up` or pipeline run is debugged from these after `down`).
    mkdir -p "$STATE/logs"
    local c
    for c in $names; do podman logs --tail 2000 "$c" >"$STATE/logs/$c.log" 2>&1 || true; done
    # shellcheck disable=SC2086
    podman rm -f -t 10 $names >/dev/null
  fi
  vols=$(podman volume ls --filter "label=$LABEL" --format '{{.Name}}')
  if [ -n "$vols" ]; then
    # shellcheck disable=SC2086
    podman volume rm -f $vols >/dev/null
  fi
  rm -f "$STATE/secrets.env" "$STATE/airflow.env"
  echo "stack: down ($(echo "$names" | grep -c . || true) containers, $(echo "$vols" | grep -c . || true) volumes removed)"
}

cmd_trigger() {
  [ -s "$STATE/secrets.env" ] || die "the stack is not up: bash scripts/stack.sh up"
  python3 docker/stack_client.py --state "$STATE" run rlhf_ppo "${1:-}"
}

case "${1:-}" in
  build) shift; cmd_build "$@" ;;
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  trigger) shift; cmd_trigger "$@" ;;
  *) die "usage: bash scripts/stack.sh build|up|down|status|trigger [CONF_JSON]" ;;
esac
