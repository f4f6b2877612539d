#!/usr/bin/env bash
# The main job (README): sets up .venv if needed, then runs the platform's demo end to end on
# embedded defaults. Extra arguments go to `rlhf demo` (see `.venv/bin/rlhf demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
source scripts/env.sh
exec .venv/bin/rlhf demo "$@"
