#!/usr/bin/env bash
# Install kvtune with its test extras and run the test suite (README's test command).
#   scripts/test.sh [PYTEST ARGS]         every tier: tests/unit, tests/integration, tests/live
#   scripts/test.sh --fast [PYTEST ARGS]  tests/unit only: pure, no server or engine, seconds
# On KVTUNE_TEST_WORKERS pytest-xdist workers (default 2; 0 runs in one process): the real-vLLM
# tests stay together on one worker, each integration or live file whole (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet -e '.[test]'
workers=(-n "${KVTUNE_TEST_WORKERS:-2}" --dist loadgroup)
if [[ ${1:-} == --fast ]]; then
    shift
    exec python -m pytest "${workers[@]}" tests/unit "$@"
fi
exec python -m pytest "${workers[@]}" "$@"
