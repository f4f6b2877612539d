# syntax=docker/dockerfile:1
#
# Airflow image: Airflow plus the provider wheel `airflow-provider-rlhf` (it pulls the library's torch-free core),
# WITHOUT torch, vLLM or transformers. Every Airflow component of the stack runs it (api-server, scheduler,
# dag-processor, triggerer, Celery worker, init). Tasks that need torch or a tokenizer are Ray jobs on the worker
# image (docker/worker.Dockerfile); see docs/deployment.md.
#
# Everything comes from the built wheels and the lock: constraints/ci.txt (the set CI ran, Airflow included) and
# constraints/stack.txt (what the stack adds: the CeleryExecutor, the FAB auth manager; scripts/lock_constraints.py
# --stack writes it). Build from the repository root, after building the wheels into the build context:
#   python scripts/build_wheels.py docker/build-context/wheels
#   docker build -f docker/airflow.Dockerfile -t rlhf-ops/airflow \
#     --build-arg RLHF_OPS_GIT_COMMIT=$(git rev-parse HEAD) .

# The lock's Airflow (constraints/ci.txt pins apache-airflow; a test checks the two agree): it names the official
# image (apache/airflow:<airflow version>-python<major.minor>). Another release needs its own lock.
ARG AIRFLOW_VERSION=3.3.2
# Not named PYTHON_VERSION: Python base images set ENV PYTHON_VERSION (x.y.z), and an ENV beats an ARG.
ARG AIRFLOW_PYTHON_VERSION=3.11
# The official image by default. A plain Debian bookworm image works too (scripts/stack.sh uses the local base of
# docker/podman-setup.sh where no registry is reachable): the first RUN below then lays out a virtualenv like the
# official image (user 50000:0, AIRFLOW_HOME=/opt/airflow, /entrypoint that prefixes `airflow` to a subcommand)
# and the install below puts Airflow into it.
ARG BASE_IMAGE=apache/airflow:${AIRFLOW_VERSION}-python${AIRFLOW_PYTHON_VERSION}
FROM ${BASE_IMAGE}

ARG AIRFLOW_VERSION
ARG AIRFLOW_PYTHON_VERSION
ARG RLHF_OPS_GIT_COMMIT=""

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# The official image's airflow user is UID 50000, GID 0.
USER 0
# Plain Debian base only (the official image has `airflow` on PATH and skips this): Python, tini, curl and an
# empty virtualenv laid out like the official image's.
ENV PATH=/home/airflow/.local/bin:${PATH} \
    AIRFLOW_HOME=/opt/airflow \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --chmod=0755 docker/airflow-entrypoint.sh /opt/rlhf/airflow-entrypoint.sh
# hadolint ignore=DL3008,DL3013
RUN if ! command -v airflow >/dev/null; then \
        apt-get update \
        && apt-get install -y --no-install-recommends "python${AIRFLOW_PYTHON_VERSION}" python3-venv \
            ca-certificates curl dumb-init procps libpq5 \
        && rm -rf /var/lib/apt/lists/* \
        && useradd --uid 50000 --gid 0 --create-home --home-dir /home/airflow airflow \
        && "python${AIRFLOW_PYTHON_VERSION}" -m venv /home/airflow/.local \
        && pip install "pip>=25" \
        && mkdir -p /opt/airflow/dags /opt/airflow/logs /opt/airflow/plugins \
        && cp /opt/rlhf/airflow-entrypoint.sh /entrypoint \
        && chown -R 50000:0 /home/airflow /opt/airflow && chmod -R g+w /opt/airflow; \
    fi \
    && mkdir -p /opt/rlhf/bin /opt/rlhf/constraints && chown -R 50000:0 /opt/rlhf
USER 50000

# Dependencies first, at the versions of the locks: the wheels' own requirements (docker/requirements_of.py reads
# them from the pyproject files; a test compares them with the wheels' Requires-Dist) plus what the stack runs on
# (the CeleryExecutor, the FAB auth manager, the PostgreSQL drivers of the metadata DB). A code change then
# rebuilds only the wheel layer below.
COPY --chown=50000:0 constraints/ci.txt constraints/stack.txt /opt/rlhf/constraints/
COPY --chown=50000:0 pyproject.toml /tmp/src/pyproject.toml
COPY --chown=50000:0 plugins/pyproject.toml /tmp/src/plugins/pyproject.toml
COPY --chown=50000:0 docker/requirements_of.py /tmp/src/requirements_of.py
# LOCK_SKIP: lock pins this image's Python cannot install, left to pip (within the packages' own bounds): the lock's
# soupsieve 4.1.4 needs Python >= 3.11.5, and Debian bookworm's python3.11 is 3.11.2. Empty on the official image.
ARG LOCK_SKIP=soupsieve
RUN if [ -n "${LOCK_SKIP}" ]; then sed -i -E "/^(${LOCK_SKIP})==/d" /opt/rlhf/constraints/ci.txt; fi \
    && python /tmp/src/requirements_of.py /tmp/src airflow-provider-rlhf > /tmp/src/requirements.txt \
    && pip install -c /opt/rlhf/constraints/ci.txt -c /opt/rlhf/constraints/stack.txt -r /tmp/src/requirements.txt \
        "apache-airflow==${AIRFLOW_VERSION}" apache-airflow-providers-celery apache-airflow-providers-fab \
        celery kombu psycopg2-binary asyncpg \
    && rm -rf /tmp/src

# The two wheels (scripts/build_wheels.py), with the locks: every dependency is already there, so this layer only
# installs the provider and the library (and fails if the wheels asked for anything else).
COPY --chown=50000:0 docker/build-context/wheels/rlhf_ops-*.whl docker/build-context/wheels/airflow_provider_rlhf-*.whl \
    /tmp/wheels/
RUN pip install -c /opt/rlhf/constraints/ci.txt -c /opt/rlhf/constraints/stack.txt /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels

# The thin DAG files (they import the factory from the provider). The provider registers the links plugin itself.
COPY --chown=50000:0 dags/ /opt/airflow/dags/
COPY --chown=50000:0 --chmod=0755 docker/airflow-init.sh /opt/rlhf/bin/airflow-init.sh

# Build-time checks: the Airflow-facing modules and the CeleryExecutor import (what the scheduler and the workers
# load), torch/vLLM/transformers did NOT leak in, and no broken requirement at all.
RUN python -c "import importlib.util as u; \
import rlhf_ops.config, rlhf_ops.tracking, rlhf_ops.tracking.mlflow_tracking, rlhf_ops.storage, rlhf_ops.pipeline.params; \
import rlhf_airflow.hooks, rlhf_airflow.operators, rlhf_airflow.triggers, rlhf_airflow.links, ray.job_submission; \
import airflow.providers.celery.executors.celery_executor, airflow.providers.fab.auth_manager.fab_auth_manager; \
leaked = [m for m in ('torch', 'vllm', 'transformers', 'flash_attn') if u.find_spec(m) is not None]; \
assert not leaked, f'heavy packages in the Airflow image: {leaked}'" \
    && pip check

ENV RLHF_OPS_GIT_COMMIT=${RLHF_OPS_GIT_COMMIT}
# The official image's own entrypoint (the Debian branch above installs the same pair).
ENTRYPOINT ["/usr/bin/dumb-init", "--", "/entrypoint"]
CMD []
LABEL org.opencontainers.image.title="rlhf-ops Airflow" \
      org.opencontainers.image.revision="${RLHF_OPS_GIT_COMMIT}"
