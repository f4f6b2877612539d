#!/usr/bin/env bash
# The lite GPU check (scripts/gpu_check_lite.py) on a bare GPU machine: torch, transformers and peft there,
# tensordict and liger-kernel carried as wheels from here.
#
#   scripts/gpu_check_lite.sh download      # here, once: the wheels into .whl/ (.gitignore'd)
#   scripts/gpu_check_lite.sh [ARGS...]     # there: install .whl/ into /tmp/site when present, run the check
#
# The JSON goes to stdout and, when $OUT is set, to $OUT/gpu_check_lite.json.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(tensordict==0.15.3 pyvers==0.2.3 liger-kernel==0.8.5)
if [[ "${1:-}" == "download" ]]; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "${WHEELS[@]}"
    ls -l .whl
    exit 0
fi
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
args=("$@")
if [[ -n "${OUT:-}" ]]; then
    args+=(--out "$OUT/gpu_check_lite.json")
fi
python3 scripts/gpu_check_lite.py "${args[@]}"
