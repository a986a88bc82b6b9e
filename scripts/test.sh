#!/usr/bin/env bash
# Install kvtune with its test extras and run the test suite (README's test command).
#   scripts/test.sh                       every tier, as CI does (below)
#   scripts/test.sh --fast [PYTEST ARGS]  tests/unit only: pure, no server or engine
#   scripts/test.sh PYTEST ARGS           one pytest with those arguments
# The whole suite runs as two pytest processes side by side, never more: 2 cores carry them and their
# servers, and a third process beside them (tried) made a vLLM's /tokenize take over 10 s to accept a
# connection, failing tests that do not measure time. One process runs the tests that start a real
# vLLM (marker `vllm`, tests/live and tests/integration: one server at a time; its worker and engine
# core take ~1.5 cores while it serves), then, once they are done, tests/unit/test_[d-z]*.py (pure: no
# server, no clock). The other runs every other test: tests/integration's small servers (nginx, Redis,
# Ray, LiteLLM, gateways and fake engines on loopback), then tests/unit/test_[a-c]*.py. The unit files
# are cut where the two end together: CI on ccde4cb (cut at f) ended the vLLM process after 708 s and
# the other after 773 s; test_docs.py and test_e*.py (~35 s) moved across, after the vLLM process's
# simulate-vs-bench test lost 14 s. Each process prints its own report, the vLLM process's after the
# other's. Then the tests marked `quiet` (a wall-clock claim of processes racing: a lease, a
# deadline) run alone on the host the others no longer load; they live in tests/integration and
# tests/live, and only those two tiers are collected for them (7 s of collecting the whole suite in
# CI), as for the vLLM tests: a unit test marked either would run in no process, so one is refused.
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
# tests/integration and tests/live split by the marker, tests/unit by file name: every test runs in
# exactly one of the two processes.
if marked=$(grep -nE '\bmark\s*\.\s*(quiet|vllm)\b' tests/unit/*.py); then
    echo "tests/unit is pure: a test marked vllm or quiet belongs in tests/integration or tests/live:" >&2
    echo "$marked" >&2
    exit 2
fi
shopt -s nullglob
after_live=(tests/unit/test_[d-z]*.py)
shopt -u nullglob
live_then_unit() {
    "${lock[@]}" python -m pytest tests/live tests/integration -m "vllm and not quiet" --basetemp "$scratch/live"
    local live=$?
    local unit=0
    if [[ ${#after_live[@]} -gt 0 ]]; then  # no path at all would be pytest's testpaths: every test
        python -m pytest "${after_live[@]}" -m "not vllm and not quiet" --basetemp "$scratch/after-live"
        unit=$?
    fi
    return $(( live != 0 ? live : unit ))
}
set +e
live_then_unit >"$scratch/live.log" 2>&1 &
live_pid=$!
python -m pytest tests -m "not vllm and not quiet" "${after_live[@]/#/--ignore=}" --basetemp "$scratch/rest"
rest=$?
wait "$live_pid"
live=$?
echo "=== the vLLM tests, then ${#after_live[@]} unit files (run beside the tests above) ==="
cat "$scratch/live.log"
echo "=== tests marked quiet (run alone) ==="
python -m pytest tests/integration tests/live -m quiet --basetemp "$scratch/quiet"
quiet=$?
set -e
for status in "$rest" "$live" "$quiet"; do
    if [[ $status -ne 0 ]]; then
        exit "$status"
    fi
done
