#!/usr/bin/env bash
# Build the docs site strictly (a broken link or anchor, a page left out of the nav, or a stale
# generated reference fails): installs the docs extra, then `mkdocs build --strict` into site/.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet -e '.[docs]'
exec python -m mkdocs build --strict "$@"
