"""What kvtune knows about each serving engine, one module per engine.

    vllm    defaults by version and GPU size, the V0/V1 boundary, metric names, startup-log lines,
            and the endpoints its OpenAI-compatible server exposes
    sglang  defaults, the environment that steers its admission estimate, its overload answer
    trtllm  trtllm-serve's defaults, its KV cache config and its capacity scheduler policies

Engines are an axis, not a branch in every function: capacity, render, check, bench and the
gateway import an engine's facts from its module. Each engine also has one launch module
(kvtune.deploy.launch: its command rendered and read back) and one capacity parser (its startup
log and metrics).
"""

from types import ModuleType

ENGINE_NAMES = ("vllm", "sglang", "trtllm")
ENGINE_TITLES = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM"}



def engine_facts(name: str) -> ModuleType:
    """The facts module of engine `name`."""
    import importlib

    if name not in ENGINE_NAMES:
        raise ValueError(f"unknown engine {name!r} (known: {', '.join(ENGINE_NAMES)})")
    return importlib.import_module(f"kvtune.engines.{name}")


__all__ = ["ENGINE_NAMES", "ENGINE_TITLES", "engine_facts"]
