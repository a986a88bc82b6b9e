"""HF config.json → ModelSpec: the facts about a model that KV-cache and weight arithmetic need.

The config is parsed once, the way vLLM reads it; raw dicts never travel further.
spec      LayerKind, ModelSpec and its parts (Attention, Mla, Mamba1/Mamba2, LinearAttention, Moe)
fields    typed reads from a config dict, errors naming file and field
config    the parser: a config dict → ModelSpec
sources   a MODEL argument → config.json: a path, a directory, a preset or a hub id
"""

from kvtune.model.config import parse_model_spec
from kvtune.model.sources import PRESETS_DIR, load_config_file, load_preset, preset_names, resolve_model
from kvtune.model.spec import (
    ATTENTION_KINDS,
    STATE_KINDS,
    Attention,
    LayerKind,
    LinearAttention,
    Mamba,
    Mamba1,
    Mamba2,
    Mla,
    ModelSpec,
    Moe,
)

__all__ = [
    "LayerKind",
    "ModelSpec",
    "Attention",
    "Mla",
    "Mamba",
    "Mamba1",
    "Mamba2",
    "LinearAttention",
    "Moe",
    "ATTENTION_KINDS",
    "STATE_KINDS",
    "PRESETS_DIR",
    "load_config_file",
    "parse_model_spec",
    "resolve_model",
    "load_preset",
    "preset_names",
]
