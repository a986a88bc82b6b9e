"""Resolving a MODEL argument: a config.json path, a model directory, a bundled preset
(kvtune/presets/*.json) or a Hugging Face hub id."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from kvtune import userfiles
from kvtune.errors import InputError, KvtuneError, OptionError, UnknownNameError
from kvtune.model.config import HUB_ID, parse_model_spec
from kvtune.model.quantization import parse_modelopt_file
from kvtune.model.spec import ModelSpec

PRESETS_DIR = Path(__file__).resolve().parent.parent / "presets"


def load_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a config.json: a regular file of at most MODEL_FILE_MAX_BYTES (kvtune.userfiles).
    Python's json accepts the Infinity/NaN literals some real configs hold, so this reader does too."""
    p = Path(path)
    data = userfiles.load_json(p, max_bytes=userfiles.MODEL_FILE_MAX_BYTES, strict=False)
    if not isinstance(data, dict):
        raise InputError(f"expected a JSON object, found {type(data).__name__}", path=str(p))
    return data


def preset_names() -> list[str]:
    """Names of the bundled presets, sorted."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def load_preset(name: str) -> ModelSpec:
    """A bundled preset by (case-insensitive) name."""
    path = PRESETS_DIR / f"{name.lower()}.json"
    if not path.is_file():
        raise _unknown(name)
    return parse_model_spec(load_config_file(path), name=name.lower(), path=str(path))


def resolve_model(source: str) -> ModelSpec:
    """A config.json path, a model directory, a preset name, or a Hugging Face hub id."""
    p = Path(source).expanduser()
    if p.is_dir():
        config = p / "config.json"
        if not config.exists():
            raise InputError("model directory has no config.json", path=str(p))
        spec = parse_model_spec(load_config_file(config), name=source, source_dir=str(p), path=str(config))
        return with_modelopt_file(spec)
    if p.exists():  # a file, or a FIFO or device that load_config_file refuses by name
        source_dir = str(p.parent) if p.name == "config.json" else None
        spec = parse_model_spec(load_config_file(p), name=source, source_dir=source_dir, path=str(p))
        return with_modelopt_file(spec)
    if (PRESETS_DIR / f"{source.lower()}.json").is_file():
        return load_preset(source)
    if _looks_like_path(source):
        raise InputError("no such file or directory", path=source)
    if HUB_ID.fullmatch(source):
        return _from_hub(source)
    raise _unknown(source)


def with_modelopt_file(spec: ModelSpec) -> ModelSpec:
    """A ModelOpt checkpoint keeps its scheme in hf_quant_config.json beside config.json (whose own
    quantization_config is then absent): read it, as vLLM does, when the config names none."""
    if spec.source_dir is None:
        return spec
    return _with_modelopt(spec, Path(spec.source_dir) / "hf_quant_config.json")


def _with_modelopt(spec: ModelSpec, path: Path | None) -> ModelSpec:
    """`spec` with the ModelOpt scheme of the hf_quant_config.json at `path`, where there is one and
    the config names no quantization itself."""
    if path is None or spec.quantization_config is not None or not path.is_file():
        return spec
    scheme = parse_modelopt_file(load_config_file(path), path=str(path), num_layers=spec.num_layers)
    if scheme is None:
        return spec
    return dataclasses.replace(spec, quantization="modelopt", quantization_bits=scheme.weight_bits,
                               quantization_config=scheme)


def _looks_like_path(source: str) -> bool:
    return source.endswith(".json") or source.startswith(("/", "./", "../", "~"))


def _unknown(name: str) -> UnknownNameError:
    names = preset_names()
    import difflib  # only for a name that is not known

    close = difflib.get_close_matches(name.lower(), names, n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else f"presets: {', '.join(names)}"
    return UnknownNameError(
        f"unknown model {name!r}: not a file, a directory, a preset or a hub id (owner/name); {hint}"
    )


def _from_hub(repo_id: str) -> ModelSpec:
    """config.json from the Hugging Face hub, or from the local cache when offline, or else the copy
    aiconfigurator-core ships (bundled_hub_config)."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise KvtuneError("huggingface_hub is not installed: pip install huggingface_hub") from exc
    try:
        local = hf_hub_download(repo_id, "config.json")
    except Exception as exc:  # every hub failure is a user-facing one
        bundled = bundled_hub_config(repo_id)
        if bundled is not None:
            return _from_bundled(repo_id, *bundled)
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        reason = ("offline (HF_HUB_OFFLINE=1) and not in the local Hugging Face cache" if offline
                  else f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'}")
        hint = _preset_for_hub_id(repo_id)
        raise KvtuneError(
            f"cannot get config.json for hub model {repo_id!r}: {reason}; "
            + (f"the bundled preset {hint!r} has this model's config" if hint
               else "pass a config.json path, a model directory or a preset name")
        ) from exc
    return parse_model_spec(load_config_file(local), name=repo_id, source_dir=str(Path(local).parent), path=local,
                            serve_id=repo_id)


#: aiconfigurator-core (the silicon step times' package) ships the config.json of ~120 hub models it
#: prices, as `<owner>--<name>_config.json`, a ModelOpt checkpoint's hf_quant_config.json beside it
#: as `<owner>--<name>_hf_quant_config.json`: copies of the hub's files, read when the hub is not.
BUNDLED_CONFIGS_PACKAGE = "aiconfigurator_core"


def bundled_hub_config(repo_id: str) -> tuple[Path, Path | None] | None:
    """aiconfigurator-core's copy of `repo_id`'s config.json (and its hf_quant_config.json, if any),
    found by name without importing the package; None where it is not installed or has no copy."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(BUNDLED_CONFIGS_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "model_configs"
    stem = repo_id.replace("/", "--").casefold()
    files = {p.name.casefold(): p for p in folder.glob("*.json")} if folder.is_dir() else {}
    config = files.get(f"{stem}_config.json")
    return None if config is None else (config, files.get(f"{stem}_hf_quant_config.json"))


def _from_bundled(repo_id: str, config: Path, quant: Path | None) -> ModelSpec:
    spec = parse_model_spec(load_config_file(config), name=repo_id, path=str(config), serve_id=repo_id)
    return _with_modelopt(spec, quant)


def _preset_for_hub_id(repo_id: str) -> str | None:
    """The preset whose `_source` names this hub id, if any (for the error hint only)."""
    for path in sorted(PRESETS_DIR.glob("*.json")):
        try:
            source = json.loads(path.read_text(encoding="utf-8")).get("_source", "")
        except (OSError, ValueError):
            continue
        if isinstance(source, str) and source.split()[0].lower() == repo_id.lower():
            return path.stem
    return None


#: Suffixes of a chat/instruction-tuned checkpoint whose config is its base model's: fine-tuning
#: changes weights, not layers, heads or dimensions (Llama-3.1-8B-Instruct's config.json differs
#: from Llama-3.1-8B's only in eos_token_id). Matched at the end of the id, any case.
TUNED_SUFFIXES = ("-Instruct", "-Chat")


def model_for_logged_id(logged: str | None) -> str:
    """The MODEL source (preset name, local directory or config.json, hub id) behind the id the logs
    name, for `recommend`/`check` without --model; an error naming the id when none is known.

    In order: a preset whose hub id is the logged id ignoring case, or its base model's (the id
    less an -Instruct/-Chat suffix; an id without an owner is compared with the hub id's name);
    a local model directory or config.json (engines log the path they loaded); a hub id whose
    config.json the Hugging Face cache (or hub) holds, or aiconfigurator-core ships a copy of."""
    if logged is None:
        raise OptionError("the logs name no model: give --model (a preset, config.json, model directory or "
                          "hub id)", field="--model")
    preset = _preset_of_logged_id(logged)
    if preset is not None:
        return preset
    p = Path(logged).expanduser()
    if (p.is_dir() and (p / "config.json").is_file()) or (p.is_file() and p.suffix == ".json"):
        return logged
    if HUB_ID.fullmatch(logged) and not _looks_like_path(logged):
        try:
            _from_hub(logged)
        except KvtuneError as exc:
            raise OptionError(f"the logs name {logged!r}, which is no preset's model, and its config.json is not in "
                              "the Hugging Face cache nor on a reachable hub: give --model", field="--model") from exc
        return logged
    raise OptionError(f"the logs name {logged!r}, which is no preset's model, local model directory or hub id: "
                      "give --model (a preset, config.json, model directory or hub id)", field="--model")


def check_logged_architecture(logged: str | None, spec: ModelSpec, given: str) -> None:
    """--model given and the logs name one model: when that id is a preset's (or its base model's)
    and its layers, heads or dimensions are not --model's, the files would serve the logged
    checkpoint with another model's memory arithmetic, so it is an error (--served-model serves
    another checkpoint on purpose). An id kvtune cannot place is served as logged."""
    preset = None if logged is None else _preset_of_logged_id(logged)
    if preset is None:
        return
    logged_spec = load_preset(preset)
    if _shape(logged_spec) != _shape(spec):
        raise OptionError(f"the logs name {logged!r}, which has the {preset} preset's architecture, not "
                          f"{given}'s: give --model {preset} (or --served-model to serve another checkpoint)",
                          field="--model")


def _shape(spec: ModelSpec) -> tuple:
    """What the memory arithmetic reads of a model: its layers, attention, widths and experts."""
    return (spec.num_layers, spec.layer_kinds, spec.attention, spec.hidden_size, spec.intermediate_size, spec.mla,
            spec.mamba, spec.linear, spec.moe)


def _preset_of_logged_id(logged: str) -> str | None:
    """The preset whose hub id is `logged`, or whose hub id is `logged` less a TUNED_SUFFIXES suffix."""
    wanted = {logged.casefold()}
    for suffix in TUNED_SUFFIXES:
        if logged.casefold().endswith(suffix.casefold()) and len(logged) > len(suffix):
            wanted.add(logged[: -len(suffix)].casefold())
    owned = "/" in logged
    for name, hub_id in _preset_hub_ids().items():
        if (hub_id if owned else hub_id.split("/", 1)[-1]).casefold() in wanted:
            return name
    return None


def _preset_hub_ids() -> dict[str, str]:
    """Preset name → the hub id its `_source` names first (presets without one left out)."""
    found: dict[str, str] = {}
    for path in sorted(PRESETS_DIR.glob("*.json")):
        source = load_config_file(path).get("_source", "")
        words = source.split() if isinstance(source, str) else []
        if words and HUB_ID.fullmatch(words[0]):
            found[path.stem] = words[0]
    return found
