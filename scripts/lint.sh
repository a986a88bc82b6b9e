#!/usr/bin/env bash
# The quality gate (after `pip install -e '.[test]'`): ruff lints the tree, mypy type-checks
# kvtune/ (configured in pyproject.toml), no `type: ignore` hides an error in kvtune/, and
# luacheck (.luacheckrc; scripts/install-test-deps.sh installs it) lints the gateway's Lua
# modules and their busted specs.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
mypy
if grep -rn --include='*.py' "type: *ignore" kvtune; then
    echo "lint: kvtune/ must type-check without 'type: ignore'" >&2
    exit 1
fi
luacheck -q kvtune/deploy/lua tests/lua
