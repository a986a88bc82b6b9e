#!/usr/bin/env bash
# Install kvtune with its test extras and run the test suite (README's test command).
#   scripts/test.sh [PYTEST ARGS]         every tier: tests/unit, tests/integration, tests/live
#   scripts/test.sh --fast [PYTEST ARGS]  tests/unit only: pure, no server or engine, seconds
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet -e '.[test]'
if [[ ${1:-} == --fast ]]; then
    shift
    exec python -m pytest tests/unit "$@"
fi
exec python -m pytest "$@"
