#!/usr/bin/env bash
# Install kvtune with its test extras and run the test suite (README's test command).
#   scripts/test.sh                       every tier, as CI does (below)
#   scripts/test.sh --fast [PYTEST ARGS]  tests/unit only: pure, no server or engine
#   scripts/test.sh PYTEST ARGS           one pytest with those arguments
# The whole suite runs as three pytest processes side by side: the tests that start a real vLLM
# (marker `vllm`, tests/live: one server at a time), the other tests with servers (tests/integration:
# nginx, Redis, Ray, gateways and fake servers on loopback; and tests/live's SGLang parser, vLLM's
# argument parser and route tables, which start no engine) and every other test (tests/unit, pure).
# The two with servers mostly wait on them (the integration tier's 1,444 tests measured 183 s of
# CPU, with the servers they started and stopped; Ray's daemons aside), so the unit tier no longer
# queues behind the integration tier for CPU it mostly leaves idle, and the engine's tests start no
# later than the parsers'. Each prints
# its own report, in that order: unit, servers, vLLM. Then the tests marked `quiet` (a wall-clock
# claim of processes racing: a lease, a deadline) run alone on the host the others no longer load.
# KVTUNE_VLLM_LOCK=FILE: the vLLM tests wait for flock on FILE first (a machine shared by several
# people, each allowed one vLLM at a time); unset, it starts at once.
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
# Each tier its own --basetemp: pytest numbers and prunes its default one, which two processes share.
lock=()
if [[ -n ${KVTUNE_VLLM_LOCK:-} ]]; then
    lock=(flock "$KVTUNE_VLLM_LOCK")
fi
# tests/integration and tests/live split by the marker: every test of theirs runs in one of the two.
"${lock[@]}" python -m pytest tests/live tests/integration -m "vllm and not quiet" --basetemp "$scratch/live" \
    >"$scratch/live.log" 2>&1 &
live_pid=$!
python -m pytest tests/integration tests/live -m "not vllm and not quiet" --basetemp "$scratch/integration" \
    >"$scratch/integration.log" 2>&1 &
integration_pid=$!
set +e
python -m pytest tests --ignore=tests/live --ignore=tests/integration -m "not quiet" --basetemp "$scratch/unit"
unit=$?
wait "$integration_pid"
integration=$?
wait "$live_pid"
live=$?
echo "=== tests/integration and tests/live but the vLLM tests (run beside the tier above) ==="
cat "$scratch/integration.log"
echo "=== the vLLM tests (run beside the tiers above) ==="
cat "$scratch/live.log"
echo "=== tests marked quiet (run alone) ==="
python -m pytest tests -m quiet --basetemp "$scratch/quiet"
quiet=$?
set -e
for status in "$unit" "$integration" "$live" "$quiet"; do
    if [[ $status -ne 0 ]]; then
        exit "$status"
    fi
done
