"""Turning the user's PATH arguments (files, directories, globs, URLs) into a list of log files."""

from __future__ import annotations

import fnmatch
import glob
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True, slots=True)
class SkippedFile:
    """An input file left unread on purpose, and why: an --exclude pattern, or kvtune's own output."""

    path: str
    reason: str


def excluded_by(relative: str, patterns: Sequence[str]) -> str | None:
    """The first --exclude pattern matching a file's path relative to the argument it was found
    under, or its base name (fnmatch: `*` also crosses `/`); None when none matches."""
    name = relative.rsplit("/", 1)[-1]
    return next((g for g in patterns if fnmatch.fnmatchcase(relative, g) or fnmatch.fnmatchcase(name, g)), None)


def _relative(match: LogFile, arg: str, root: Path | None) -> str:
    """A file's path as --exclude matches it: under a directory argument, relative to it; a URL
    under the URL given; anything else as found."""
    if isinstance(match, RemoteFile):  # compared without the scheme: fsspec writes memory://f as memory:///f
        url, prefix = (text.partition("://")[2].lstrip("/") for text in (match.url, arg.rstrip("/") + "/"))
        return url[len(prefix):] if url.startswith(prefix) else match.url
    if root is not None:
        return match.relative_to(root).as_posix()
    return match.as_posix()


def expand_paths(paths: Iterable[str | os.PathLike[str]]) -> list[LogFile]:
    """Files as given, directories recursively (log-like names only), globs expanded; no duplicates
    (`expand_inputs` with no --exclude)."""
    return expand_inputs(paths)[0]


def expand_inputs(
    paths: Iterable[str | os.PathLike[str]], exclude: Sequence[str] = ()
) -> tuple[list[LogFile], list[SkippedFile]]:
    """(the log files to read, those an --exclude pattern left out): files as given, directories
    recursively (log-like names only), globs expanded; no duplicates.

    A URL (`s3://…`, `https://…`, `memory://…`) is listed through fsspec the same way
    (`remote.expand_url`). An argument that matches nothing is an error: a typo must not become an
    empty profile (files it matched that --exclude then left out are reported, not an error).
    """
    out: list[LogFile] = []
    skipped: list[SkippedFile] = []
    seen: set[Path | str] = set()

    def keep(match: LogFile, arg: str, root: Path | None) -> bool:
        pattern = excluded_by(_relative(match, arg, root), exclude) if exclude else None
        if pattern is not None:
            skipped.append(SkippedFile(str(match), f"--exclude {pattern}"))
        return pattern is None

    for arg in paths:
        text = os.fspath(arg)
        if protocol(text) is not None:
            for remote in expand_url(text, is_log_name):
                if remote.url not in seen:
                    seen.add(remote.url)
                    if keep(remote, text, None):
                        out.append(remote)
            continue
        p = Path(text)
        root = p if p.is_dir() else None
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
                if keep(match, text, root):
                    out.append(match)
    return out, skipped
