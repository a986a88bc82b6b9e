"""Each engine's launch files, rendered from a recommendation and read back, one module per engine.

    vllm    vllm-serve.sh (`vllm serve`)
    sglang  sglang-serve.sh (`python -m sglang.launch_server`, with the SGLANG_* environment)
    trtllm  trtllm-serve.sh and trtllm-llm-api.yaml (its --extra_llm_api_options)

A launch module renders every line with the rule that produced it and why (a `Line`), and reads
the same files back into a kvtune.deploy.deployed.Deployed, so `recommend` gates what it renders
by reading it back and `check` judges what is deployed by the same field names. Adding an engine
is one module here, its facts in kvtune.engines, its template and its capacity parser.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

from kvtune.engines import ENGINE_NAMES
from kvtune.errors import UnknownNameError


@dataclass(frozen=True, slots=True)
class Line:
    """One line of a launch file: a flag, an environment variable or a config key, its value, and
    the rule that set it and why (rendered beside it as a comment)."""

    name: str
    value: Any
    rule: str
    reason: str


def launcher(engine: str) -> ModuleType:
    """The launch module of `engine` ("vllm", "sglang", "trtllm")."""
    import importlib

    if engine not in ENGINE_NAMES:
        raise UnknownNameError(f"unknown engine {engine!r} (known: {', '.join(ENGINE_NAMES)})", field="engine")
    return importlib.import_module(f"kvtune.deploy.launch.{engine}")


def launchers() -> list[ModuleType]:
    return [launcher(name) for name in ENGINE_NAMES]


__all__ = ["Line", "launcher", "launchers"]
