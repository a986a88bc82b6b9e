"""kvtune: KV-cache sizing, output caps and admission settings for self-hosted LLM serving.

The Python API (kvtune.api) runs the same pipeline as `kvtune recommend`:

    import kvtune

    profile = kvtune.profile_logs(["sample_logs/"])             # logs -> per-route histograms
    deployment = kvtune.Deployment("llama-3.1-8b", gpu="H100-80GB")  # model + GPUs + engine
    rec = kvtune.recommend(profile, deployment)                 # -> caps, budget, settings
    kvtune.write_files("deploy/", kvtune.render(rec))           # -> vllm-serve.sh, gateway.yaml, ...
    result = kvtune.check(rec, ["deploy/vllm-serve.sh", "deploy/gateway.yaml"])

The names load on first use (kvtune.api loads each stage's module when one of its names is
asked for), so `import kvtune` (and the CLI's startup) stays cheap.
"""

from __future__ import annotations

from typing import Any

from kvtune import api
from kvtune.version import __version__

__all__ = [*api.__all__, "__version__"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(api, name)
    raise AttributeError(f"module 'kvtune' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
