"""Counting tokens for logs that carry text but no usage numbers, with the `tokenizers` library.

Counts are of the raw text (no chat template), so they can differ from the server's usage by the
few template tokens per message; `encode_batch` spreads each batch over all cores.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtune.errors import InputError


def chat_template_of(config: dict, fallback: str | None = None) -> str | None:
    """tokenizer_config.json's chat template (the "default" one of a named list), else `fallback`."""
    raw = config.get("chat_template")
    if isinstance(raw, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        raw = named.get("default") or next(iter(named.values()), None)
    return raw if isinstance(raw, str) else fallback


def read_chat_template(folder: Path) -> tuple[dict, str | None]:
    """(tokenizer_config.json as read or {}, the chat template or None) of a model directory: the
    config's template wins over chat_template.jinja. An unreadable config is an InputError."""
    config: dict = {}
    cfg_path = folder / "tokenizer_config.json"
    if cfg_path.is_file():
        try:
            config = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise InputError(f"cannot read tokenizer_config.json: {exc}", path=str(cfg_path)) from exc
        if not isinstance(config, dict):
            raise InputError("tokenizer_config.json is not a JSON object", path=str(cfg_path))
    jinja_path = folder / "chat_template.jinja"
    template = jinja_path.read_text(encoding="utf-8") if jinja_path.is_file() else None
    return config, chat_template_of(config, template)


def load_tokenizer(spec: str) -> Any:
    """A `tokenizers.Tokenizer` from a tokenizer.json path, a model directory, or a hub id."""
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:  # pragma: no cover - tokenizers is a hard dependency
        raise InputError("counting tokens needs the `tokenizers` package: pip install tokenizers") from exc
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
        if not path.is_file():
            raise InputError("model directory has no tokenizer.json", path=spec, field="tokenizer")
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception as exc:
            raise InputError(f"not a tokenizers JSON file: {exc}", path=str(path)) from exc
    if os.sep in spec and spec.count("/") > 1 or spec.startswith((".", "~")):
        raise InputError("no such tokenizer file or directory", path=spec, field="tokenizer")
    try:
        import huggingface_hub  # noqa: F401  (hub_file reads the cache with it)
    except ImportError as exc:
        raise InputError(
            "a hub id needs huggingface_hub (pip install huggingface_hub), or pass a tokenizer.json",
            field="--tokenizer",
        ) from exc
    try:
        local = hub_file(spec, "tokenizer.json")
    except InputError as exc:
        raise InputError(exc.message, field="--tokenizer") from exc
    return Tokenizer.from_file(local)


def hub_file(repo_id: str, filename: str) -> str:
    """A file of a hub model, offline first: the Hugging Face cache, then (unless HF_HUB_OFFLINE)
    the hub. Missing from both: one InputError saying how to put it in the cache."""
    from huggingface_hub import constants, hf_hub_download

    try:
        return hf_hub_download(repo_id=repo_id, filename=filename, local_files_only=True)
    except Exception as cached_exc:
        if not constants.HF_HUB_OFFLINE:
            try:
                return hf_hub_download(repo_id=repo_id, filename=filename)
            except Exception:  # unreachable, gated, no such repo: say what fixes it
                pass
        raise InputError(f"{repo_id} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and the hub "
                         f"cannot be reached: run huggingface-cli download {repo_id} tokenizer.json "
                         "tokenizer_config.json, or set tokenizer: to a local directory") from cached_exc


def count_tokens(tokenizer: Any, texts: Sequence[str]) -> list[int]:
    """Token counts of many texts in one parallel call, without special tokens."""
    if not texts:
        return []
    encodings = tokenizer.encode_batch(list(texts), add_special_tokens=False)
    return [len(e.ids) for e in encodings]
