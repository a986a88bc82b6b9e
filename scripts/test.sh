#!/usr/bin/env bash
# Install kvtune with its test extras and run the test suite (README's test command).
#   scripts/test.sh                       every tier, as CI does (below)
#   scripts/test.sh --fast [PYTEST ARGS]  tests/unit only: pure, no server or engine
#   scripts/test.sh PYTEST ARGS           one pytest with those arguments
# The whole suite runs as two pytest processes side by side: the tests that start a real vLLM
# (marker `vllm`, tests/live and tests/integration: one server at a time, mostly waiting on the
# engine) and every other test (tests/unit, and the tests with small servers: nginx, Redis, Ray,
# LiteLLM, gateways and fake engines on loopback). A third process beside them was tried (the unit
# tier on its own): 2 cores then carried three tiers, the lint and their servers, and a vLLM's
# /tokenize took over 10 s to accept a connection, failing tests that do not measure time. Each
# prints its own report, the vLLM tests' after the rest. Then the tests marked `quiet` (a
# wall-clock claim of processes racing: a lease, a deadline) run alone on the host the others no
# longer load.
# KVTUNE_VLLM_LOCK=FILE: the vLLM tests wait for flock on FILE first (a machine shared by several
# people, each allowed one vLLM at a time); unset, they start at once.
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
# Each process its own --basetemp: pytest numbers and prunes its default one, which two processes share.
lock=()
if [[ -n ${KVTUNE_VLLM_LOCK:-} ]]; then
    lock=(flock "$KVTUNE_VLLM_LOCK")
fi
# tests/integration and tests/live split by the marker: every test of theirs runs in one of the two.
"${lock[@]}" python -m pytest tests/live tests/integration -m "vllm and not quiet" --basetemp "$scratch/live" \
    >"$scratch/live.log" 2>&1 &
live_pid=$!
set +e
python -m pytest tests -m "not vllm and not quiet" --basetemp "$scratch/rest"
rest=$?
wait "$live_pid"
live=$?
echo "=== the vLLM tests (run beside the tests above) ==="
cat "$scratch/live.log"
echo "=== tests marked quiet (run alone) ==="
python -m pytest tests -m quiet --basetemp "$scratch/quiet"
quiet=$?
set -e
for status in "$rest" "$live" "$quiet"; do
    if [[ $status -ne 0 ]]; then
        exit "$status"
    fi
done
