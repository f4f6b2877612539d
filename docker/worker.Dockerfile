# syntax=docker/dockerfile:1
#
# GPU worker image: every Ray node of the platform (head and GPU workers) runs it, and so do the Ray jobs the
# Airflow DAGs submit (prepare_data, train, evaluate, HF export): CUDA torch, vLLM, flash-attn, liger-kernel,
# Ray and the platform (rlhf_ops + workers).
#
# Build from the repository root (the compose file does this):
#   docker build -f docker/worker.Dockerfile --build-arg RLHF_OPS_GIT_COMMIT=$(git rev-parse HEAD) -t rlhf-ops/worker .
#
# Version set (mutually compatible; see docs/deployment.md "Image versions" for the sources):
#   torch 2.13.0   the PyPI build is CUDA 13.0 (cuda-toolkit 13.0.3, NCCL 2.29.7, triton 3.7.1)
#   vllm 0.32.0    pins torch==2.13.0, transformers>=5.16.1,<5.20, flashinfer-python 0.7.0.post1 (CUDA 13 kernels)
#   flash-attn 2.8.3.post2, compiled here against that torch (no official wheel for torch 2.13 + CUDA 13)
#   liger-kernel 0.8.5, ray 2.60.0, mlflow-skinny 3.17.2 (client of the 3.17.2 server)
# Host requirement: NVIDIA driver >= 580 (CUDA 13.0) and the NVIDIA Container Toolkit.

# The devel flavour on purpose: flash-attn compiles here, and at run time FlashInfer and Triton JIT-compile
# kernels (they need nvcc and the CUDA headers); vLLM's own image uses a devel base for the same reason.
ARG BASE_IMAGE=nvidia/cuda:13.0.2-devel-ubuntu24.04
ARG TORCH_VERSION=2.13.0
ARG VLLM_VERSION=0.32.0

############################ base: Python 3.12 venv with CUDA torch + vLLM + deps ############################
FROM ${BASE_IMAGE} AS base

ARG UV_VERSION=0.13.9
ARG TORCH_VERSION
ARG VLLM_VERSION

ENV DEBIAN_FRONTEND=noninteractive \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    UV_LINK_MODE=copy \
    UV_HTTP_TIMEOUT=600 \
    UV_PYTHON_DOWNLOADS=never

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Ubuntu 24.04's own Python is 3.12 (pyproject allows 3.11-3.12). python3.12-dev + build-essential: Triton
# compiles a small C launcher against Python.h at run time, and flash-attn compiles here. libnuma1 and
# libibverbs1: NCCL (InfiniBand) and fastsafetensors. procps: pgrep for the healthcheck. tini: PID 1.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3.12 python3.12-dev python3.12-venv \
        build-essential ca-certificates curl git procps tini libnuma1 libibverbs1 \
    && rm -rf /var/lib/apt/lists/* \
    && python3.12 -m venv "${VIRTUAL_ENV}" \
    && pip install "uv==${UV_VERSION}"

# One resolver pass over the CUDA pins and every other dependency, so nothing can move torch afterwards: the library
# wheel's requirements for `train` (docker/requirements_of.py reads them from pyproject.toml), the GPU-only
# packages (docker/requirements-gpu.txt), at the versions of constraints/ci.txt, less the pins that belong to the
# lock's CPU build (docker/requirements-gpu.txt names them: the CUDA torch and vllm set their own).
COPY constraints/ci.txt /opt/rlhf/constraints/ci.txt
COPY pyproject.toml /tmp/src/pyproject.toml
COPY plugins/pyproject.toml /tmp/src/plugins/pyproject.toml
COPY docker/requirements_of.py docker/requirements-gpu.txt /tmp/src/
RUN --mount=type=cache,target=/root/.cache/uv \
    cpu_only=$(sed -n 's/^# cpu-build-pin: *//p' /tmp/src/requirements-gpu.txt | paste -sd'|') \
    && grep -v -E "^(${cpu_only})==" /opt/rlhf/constraints/ci.txt > /opt/rlhf/constraints/ci-gpu.txt \
    && python /tmp/src/requirements_of.py /tmp/src 'rlhf-ops[train]' > /tmp/src/requirements.txt \
    && uv pip install -c /opt/rlhf/constraints/ci-gpu.txt "torch==${TORCH_VERSION}" "vllm==${VLLM_VERSION}" \
        -r /tmp/src/requirements.txt -r /tmp/src/requirements-gpu.txt \
    && rm -rf /tmp/src \
    && python -c "import torch; assert torch.__version__.split('+')[0] == '${TORCH_VERSION}', torch.__version__; \
assert torch.version.cuda and torch.version.cuda.startswith('13.'), torch.version.cuda"

############################ flash-attn: one wheel, built against the torch above ############################
FROM base AS flash-attn

ARG FLASH_ATTN_VERSION=2.8.3.post2
# SM architectures to compile: 80 = A100/A10, 90 = H100/H200. Add 100 (B200) and 120 (RTX 50xx / RTX PRO)
# for Blackwell; each one adds build time. MAX_JOBS bounds parallel nvcc processes (each needs ~4-8 GB RAM).
ARG FLASH_ATTN_CUDA_ARCHS="80;90"
ARG MAX_JOBS=8
ARG NVCC_THREADS=2
# Optional prebuilt wheel (flash_attn-*+cu13torch2.13*-cp312-cp312-linux_x86_64.whl) to skip the compile.
ARG FLASH_ATTN_WHEEL_URL=""

# setup.py first looks for an official prebuilt wheel matching torch/CUDA/Python on the project's releases
# and compiles from the sdist when there is none (the case for torch 2.13 + CUDA 13 as of late 2026).
RUN --mount=type=cache,target=/root/.cache/uv \
    uv pip install wheel ninja packaging einops psutil \
    && mkdir -p /wheels \
    && if [ -n "${FLASH_ATTN_WHEEL_URL}" ]; then \
        name=$(python -c "import posixpath, sys, urllib.parse as u; \
print(u.unquote(posixpath.basename(u.urlsplit(sys.argv[1]).path)))" "${FLASH_ATTN_WHEEL_URL}") \
        && curl -fsSL --retry 3 -o "/wheels/${name}" "${FLASH_ATTN_WHEEL_URL}"; \
    else \
        FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}" MAX_JOBS="${MAX_JOBS}" NVCC_THREADS="${NVCC_THREADS}" \
        pip wheel --no-build-isolation --no-deps -w /wheels "flash-attn==${FLASH_ATTN_VERSION}"; \
    fi \
    && ls -l /wheels

############################ runtime: the image every Ray node runs ############################
FROM base AS runtime
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ARG VLLM_VERSION
ARG RLHF_OPS_GIT_COMMIT=""
ARG RAY_UID=1000

COPY --from=flash-attn /wheels /tmp/wheels
RUN --mount=type=cache,target=/root/.cache/uv \
    uv pip install --no-deps /tmp/wheels/*.whl && rm -rf /tmp/wheels

# The library wheel (scripts/build_wheels.py) last, its dependencies all installed above (--no-deps: its `gpu`
# extra names flash-attn, which is the wheel built above, not an index release); `pip check` below proves none is
# missing or at another version.
COPY docker/build-context/wheels/rlhf_ops-*.whl /tmp/wheels/
RUN --mount=type=cache,target=/root/.cache/uv \
    wheel=$(compgen -G "/tmp/wheels/rlhf_ops-*.whl") \
    && uv pip install --no-deps -c /opt/rlhf/constraints/ci-gpu.txt "${wheel}[train,gpu]" \
    && rm -rf /tmp/wheels

COPY --chmod=0755 docker/ray-entrypoint.sh /usr/local/bin/ray-entrypoint.sh

# Build-time checks (no GPU here): versions as pinned, the platform importable, and no broken requirement.
RUN python -c "import importlib.metadata as md; import torch, ray, pynvml, rlhf_ops.config, rlhf_ops.storage, \
rlhf_ops.tracking.mlflow_tracking, workers; \
v = {d: md.version(d) for d in ('vllm', 'flash-attn', 'liger-kernel', 'mlflow-skinny')}; \
assert v['vllm'] == '${VLLM_VERSION}', v; assert ray.__version__ == '2.60.0', ray.__version__; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'ray', ray.__version__, v)" \
    && pip check

# Non-root user; /checkpoints and /models exist owned by it, so fresh named volumes mounted there inherit the
# ownership (Docker copies the image directory's owner into an empty named volume).
RUN (userdel -r ubuntu 2>/dev/null || true) \
    && useradd --create-home --uid "${RAY_UID}" --shell /bin/bash ray \
    && mkdir -p /checkpoints /models /home/ray/.cache \
    && chown -R ray:ray /checkpoints /models /home/ray/.cache

# No hub at run time: weights and tokenizers come from /models (or another shared path) only.
# (DL3064 flags TOKENIZERS_PARALLELISM for its name; it is no secret.)
# hadolint ignore=DL3064
ENV RLHF_OPS_GIT_COMMIT=${RLHF_OPS_GIT_COMMIT} \
    RAY_USAGE_STATS_ENABLED=0 \
    RAY_DEDUP_LOGS=0 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_DATASETS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    RLHF_CACHE_DIR=/home/ray/.cache/rlhf_ops

LABEL org.opencontainers.image.title="rlhf-ops GPU worker" \
      org.opencontainers.image.revision="${RLHF_OPS_GIT_COMMIT}"

USER ${RAY_UID}
WORKDIR /home/ray
EXPOSE 6379 8265 10001
# tini reaps the Ray processes' children and forwards SIGTERM, so `docker stop` stops Ray cleanly.
ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/ray-entrypoint.sh"]
