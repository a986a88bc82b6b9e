#!/usr/bin/env bash
# Install kvtune with its test extras and run the test suite (README's test command).
#   scripts/test.sh                       every tier, as CI does (below)
#   scripts/test.sh --fast [PYTEST ARGS]  tests/unit only: pure, no server or engine
#   scripts/test.sh PYTEST ARGS           one pytest with those arguments
# The whole suite runs as two pytest processes side by side: tests/live (the real vLLM, one server
# at a time, mostly waiting on the engine) and every other test, whose servers are small; each
# prints its own report, the live tier's after the rest. Then the tests marked `quiet` (a wall-clock
# claim of processes racing: a lease, a deadline) run alone on the host the others no longer load.
# Exit: the first failure's status.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet -e '.[test]'
if [[ ${1:-} == --fast ]]; then
    shift
    exec python -m pytest tests/unit "$@"
fi
if [[ $# -gt 0 ]]; then
    exec python -m pytest "$@"
fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
python -m pytest tests/live -m "not quiet" --basetemp "$scratch/tmp" >"$scratch/live.log" 2>&1 &
live_pid=$!
set +e
python -m pytest tests --ignore=tests/live -m "not quiet"
rest=$?
wait "$live_pid"
live=$?
echo "=== tests/live (run beside the tiers above) ==="
cat "$scratch/live.log"
echo "=== tests marked quiet (run alone) ==="
python -m pytest tests -m quiet
quiet=$?
set -e
for status in "$rest" "$live" "$quiet"; do
    if [[ $status -ne 0 ]]; then
        exit "$status"
    fi
done
