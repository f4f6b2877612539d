# syntax=docker/dockerfile:1
#
# MLflow tracking server of the compose stack: PostgreSQL backend store, artifacts proxied to S3 (MinIO / moto).
# The server's release matches the client the platform pins (mlflow==3.17.2 in pyproject, mlflow-skinny==3.17.2
# in the images). psycopg2 for the postgresql+psycopg2:// store, boto3 for the s3:// artifact destination.
#
# BASE_IMAGE: the official python:3.11-slim by default; any Debian image works (without pip, Debian's python3
# is installed into a virtualenv first): scripts/stack.sh builds on the local base of docker/podman-setup.sh.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG MLFLOW_VERSION=3.17.2
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:${PATH} \
    MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false

SHELL ["/bin/sh", "-exc"]
# hadolint ignore=DL3008
RUN if ! command -v pip >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
        && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/venv; \
    fi \
    && pip install "mlflow==${MLFLOW_VERSION}" "psycopg2-binary==2.9.13" "boto3==1.43.117" \
    && useradd --create-home --uid 1000 mlflow

USER 1000
WORKDIR /home/mlflow
EXPOSE 5000
# The command (store URIs, allowed hosts, workers) comes from docker/compose.yaml or scripts/stack.sh.
CMD ["mlflow", "server", "--host", "0.0.0.0", "--port", "5000"]
