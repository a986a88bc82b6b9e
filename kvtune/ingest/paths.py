"""Turning the user's PATH arguments (files, directories, globs, URLs) into a list of log files."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TypeAlias

from kvtune.errors import InputError
from kvtune.ingest.remote import RemoteFile, expand_url, protocol

#: One log file to read: a local path, or an object in a store (`kvtune.ingest.remote`).
LogFile: TypeAlias = Path | RemoteFile

# Data extensions looked for inside directories; explicit file arguments are taken as given.
DATA_SUFFIXES = (".jsonl", ".ndjson", ".json", ".csv", ".tsv", ".parquet", ".pq")
COMPRESSION_SUFFIXES = (".gz", ".zst", ".zstd")


def is_log_name(name: str) -> bool:
    """True for names like `a.jsonl`, `b.csv.gz`, `c.parquet` (hidden files excluded)."""
    if name.startswith("."):
        return False
    lower = name.lower()
    for comp in ("", *COMPRESSION_SUFFIXES):
        if lower.endswith(comp) and lower[: len(lower) - len(comp)].endswith(DATA_SUFFIXES):
            return True
    return False


def _walk(directory: Path) -> list[Path]:
    found: list[Path] = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found.extend(Path(root, f) for f in sorted(files) if is_log_name(f))
    return found


def expand_paths(paths: Iterable[str | os.PathLike[str]]) -> list[LogFile]:
    """Files as given, directories recursively (log-like names only), globs expanded; no duplicates.

    A URL (`s3://…`, `https://…`, `memory://…`) is listed through fsspec the same way
    (`remote.expand_url`). An argument that matches nothing is an error: a typo must not become an
    empty profile.
    """
    out: list[LogFile] = []
    seen: set[Path | str] = set()
    for arg in paths:
        text = os.fspath(arg)
        if protocol(text) is not None:
            for remote in expand_url(text, is_log_name):
                if remote.url not in seen:
                    seen.add(remote.url)
                    out.append(remote)
            continue
        p = Path(text)
        if p.is_dir():
            matches = _walk(p)
            if not matches:
                raise InputError(
                    "directory holds no log files (.jsonl, .json, .csv, .tsv, .parquet, "
                    "optionally .gz/.zst)",
                    path=text,
                )
        elif p.exists():
            matches = [p]
        elif os.path.lexists(text):
            raise InputError("a symbolic link to nothing (or a loop of links)", path=text)
        elif glob.has_magic(text):
            matches = []
            for m in sorted(glob.glob(text, recursive=True)):
                mp = Path(m)
                matches.extend(_walk(mp) if mp.is_dir() else [mp])
            if not matches:
                raise InputError("no files match this pattern", path=text)
        else:
            raise InputError("no such file or directory", path=text)
        for match in matches:
            key = Path(os.path.realpath(match))  # never raises: a link loop is reported when it is read
            if key not in seen:
                seen.add(key)
                out.append(match)
    return out
