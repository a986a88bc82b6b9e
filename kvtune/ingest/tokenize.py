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
        from huggingface_hub import hf_hub_download
    except ImportError as exc:
        raise InputError(
            "a hub id needs huggingface_hub (pip install huggingface_hub), or pass a tokenizer.json",
            field="--tokenizer",
        ) from exc
    try:
        local = hf_hub_download(repo_id=spec, filename="tokenizer.json")
    except Exception as exc:
        raise InputError(
            f"cannot fetch tokenizer.json for hub id {spec!r} ({type(exc).__name__}); "
            "pass a local tokenizer.json or model directory",
            field="--tokenizer",
        ) from exc
    return Tokenizer.from_file(local)


def count_tokens(tokenizer: Any, texts: Sequence[str]) -> list[int]:
    """Token counts of many texts in one parallel call, without special tokens."""
    if not texts:
        return []
    encodings = tokenizer.encode_batch(list(texts), add_special_tokens=False)
    return [len(e.ids) for e in encodings]
