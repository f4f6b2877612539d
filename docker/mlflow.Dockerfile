# syntax=docker/dockerfile:1
#
# MLflow tracking server of the compose stack: PostgreSQL backend store, artifacts proxied to S3 (MinIO / moto).
# The server, psycopg2 (the postgresql+psycopg2:// store) and boto3 (the s3:// artifact destination) at the versions of
# constraints/ci.txt, the set CI ran (the server there is the client's release, mlflow-skinny).
#
# Build from the repository root:
#   docker build -f docker/mlflow.Dockerfile -t rlhf-ops/mlflow .
#
# BASE_IMAGE: the official python:3.11-slim by default; any Debian image works (without pip, Debian's python3
# is installed into a virtualenv first): scripts/stack.sh builds on the local base of docker/podman-setup.sh.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:${PATH} \
    MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false

SHELL ["/bin/sh", "-exc"]
COPY constraints/ci.txt /opt/rlhf/constraints/ci.txt
# hadolint ignore=DL3008,DL3013
RUN if ! command -v pip >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
        && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/venv; \
    fi \
    && pip install -c /opt/rlhf/constraints/ci.txt mlflow psycopg2-binary boto3 \
    && useradd --create-home --uid 1000 mlflow

USER 1000
WORKDIR /home/mlflow
EXPOSE 5000
# The command (store URIs, allowed hosts, workers) comes from docker/compose.yaml or scripts/stack.sh.
CMD ["mlflow", "server", "--host", "0.0.0.0", "--port", "5000"]
