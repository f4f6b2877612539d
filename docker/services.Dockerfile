# syntax=docker/dockerfile:1
#
# Local stand-ins for the third-party images of the stack, for hosts that cannot pull them (scripts/stack.sh on
# the development machines): PostgreSQL 15 and Redis from Debian's packages, and moto's S3 server (MinIO images
# cannot be pulled there). One image, three commands (see scripts/stack.sh):
#   pg-entrypoint.sh          PostgreSQL: initdb + the airflow / mlflow roles on an empty volume, then postgres
#   redis-server --port P     the Celery broker of the Airflow workers
#   moto_server -H 127.0.0.1 -p P   S3 API (state in memory: buckets live as long as the container)
#
# Build from the repository root:
#   podman build -f docker/services.Dockerfile --build-arg BASE_IMAGE=local/debian:bookworm -t rlhf-ops/services .
# BASE_IMAGE: any Debian bookworm image (official debian:bookworm-slim by default; the tests use the local base
# made by docker/podman-setup.sh).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PATH=/opt/venv/bin:/usr/lib/postgresql/15/bin:${PATH} \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# moto at the version of constraints/ci.txt (the S3 server the tests ran against).
COPY constraints/ci.txt /opt/rlhf/constraints/ci.txt
# hadolint ignore=DL3008,DL3013
RUN apt-get update \
    && apt-get install -y --no-install-recommends postgresql-15 redis-server python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && pip install -c /opt/rlhf/constraints/ci.txt "moto[server]"

COPY --chmod=0755 docker/postgres/pg-entrypoint.sh /usr/local/bin/pg-entrypoint.sh
COPY --chmod=0755 docker/postgres/init-databases.sh /usr/local/bin/init-databases.sh
