#!/usr/bin/env bash
# The quality gate (after `pip install -e '.[test]'`): ruff lints the tree, mypy type-checks
# kvtune/ (configured in pyproject.toml), and no `type: ignore` hides an error in kvtune/.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
mypy
if grep -rn --include='*.py' "type: *ignore" kvtune; then
    echo "lint: kvtune/ must type-check without 'type: ignore'" >&2
    exit 1
fi
