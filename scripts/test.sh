#!/usr/bin/env bash
# Install kvtune with its test extras and run the whole test suite (README's test command).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet -e '.[test]'
exec python -m pytest "$@"
