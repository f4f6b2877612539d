#!/usr/bin/env bash
# The test command (README, .ci/run): sets up .venv if needed, then lint, type check and tests.
# Default: every suite except those marked slow, plus the end-to-end pipeline once.
# RLHF_TEST_SLOW=1 adds the slow suites. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
source scripts/env.sh
echo "== ruff" && .venv/bin/ruff check . && .venv/bin/ruff format --check .
echo "== mypy" && .venv/bin/mypy
marker="not slow"
[ "${RLHF_TEST_SLOW:-0}" = "1" ] && marker=""
echo "== pytest"
set +e
.venv/bin/python -m pytest -m "$marker" -p no:cacheprovider "$@"
rc=$?
set -e
[ $rc -eq 5 ] && { echo "no tests collected"; exit 1; }
exit $rc
