#!/usr/bin/env bash
# One-shot initialisation of the Airflow metadata DB for the compose stack (service airflow-init):
#   1. `airflow db migrate` (idempotent: a no-op on an up-to-date schema);
#   2. the admin user of the FAB auth manager (kept if it exists);
#   3. the connections the platform's DAGs use, rewritten from the environment on every run so that editing
#      docker/.env and re-running `docker compose up airflow-init` updates them:
#        ray_default     type ray:  the Ray dashboard / job server; password = Ray auth token (if any)
#        aws_default     type aws:  S3 credentials and endpoint of the Airflow tasks; a Ray job gets only the
#                                   endpoint and region (AWS_ENDPOINT_URL_S3, ...): the Ray nodes have their own keys
#        mlflow_default  type http: the MLflow tracking server (MLFLOW_TRACKING_URI of the Ray job)
#   4. the pool of the Ray cluster's capacity that `train` and `evaluate` take slots of (plugins/rlhf_airflow/
#      pools.py; the scheduler never runs a task whose pool is missing), created when missing: its size is the
#      deployer's to change afterwards (`airflow pools set rlhf_cluster 8 ... --include-deferred`).
# Connection secrets go from the environment through a private temp file, never onto a command line. (The admin
# password does, for `airflow users create`: fine for this one-shot dev container, not for production.)
set -euo pipefail

: "${AIRFLOW_ADMIN_USERNAME:?set AIRFLOW_ADMIN_USERNAME}"
: "${AIRFLOW_ADMIN_PASSWORD:?set AIRFLOW_ADMIN_PASSWORD}"

echo "airflow-init: migrating the metadata DB"
airflow db migrate

echo "airflow-init: admin user ${AIRFLOW_ADMIN_USERNAME}"
# FAB's `users create` prints "... already exist in the db" and exits 0 when the user exists.
airflow users create --role Admin \
  --username="${AIRFLOW_ADMIN_USERNAME}" --password="${AIRFLOW_ADMIN_PASSWORD}" \
  --firstname Airflow --lastname Admin --email "${AIRFLOW_ADMIN_EMAIL:-admin@example.com}"

# All three connections as one JSON document ({conn_id: fields}), built from environment variables (defaults in
# the compose file), written to a private temp file and imported with --overwrite.
write_connections() {
  python - "$1" <<'PY'
import json
import os
import sys

env = os.environ.get
ray = {"conn_type": "ray", "host": env("RLHF_RAY_DASHBOARD_HOST", "ray-head"),
       "port": int(env("RLHF_RAY_DASHBOARD_PORT", "8265")), "schema": env("RLHF_RAY_DASHBOARD_SCHEME", "http")}
if env("RAY_AUTH_TOKEN"):
    ray["password"] = env("RAY_AUTH_TOKEN")  # sent as "Authorization: Bearer <token>" by RayJobHook
s3_extra = {"region_name": env("RLHF_S3_REGION", "us-east-1")}
if env("RLHF_S3_ENDPOINT_URL"):
    s3_extra["endpoint_url"] = env("RLHF_S3_ENDPOINT_URL")
connections = {
    "ray_default": ray,
    "aws_default": {"conn_type": "aws", "login": env("RLHF_S3_ACCESS_KEY_ID", ""),
                    "password": env("RLHF_S3_SECRET_ACCESS_KEY", ""), "extra": json.dumps(s3_extra)},
    "mlflow_default": {"conn_type": "http", "host": env("RLHF_MLFLOW_HOST", "mlflow"),
                       "port": int(env("RLHF_MLFLOW_PORT", "5000")), "schema": env("RLHF_MLFLOW_SCHEME", "http")},
}
with open(sys.argv[1], "w", encoding="utf-8") as out:
    json.dump(connections, out)
PY
}

conn_file=$(mktemp --suffix=.json)  # mode 0600
trap 'rm -f "${conn_file}"' EXIT
write_connections "${conn_file}"
echo "airflow-init: connections ray_default, aws_default, mlflow_default"
airflow connections import --overwrite "${conn_file}"

pool="${RLHF_CLUSTER_POOL:-rlhf_cluster}"
if airflow pools get "${pool}" >/dev/null 2>&1; then
  echo "airflow-init: pool ${pool} exists (kept)"
else
  echo "airflow-init: pool ${pool} (${RLHF_CLUSTER_POOL_SLOTS:-4} slots, deferred tasks included)"
  airflow pools set "${pool}" "${RLHF_CLUSTER_POOL_SLOTS:-4}" "Ray cluster capacity of the RLHF pipelines" \
    --include-deferred
fi

echo "airflow-init: done"
