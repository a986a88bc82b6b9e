"""Log files where they live: object stores and web servers, read through fsspec with ranged reads.

A URL argument (`s3://`, `gs://`, `az://`/`abfs://`, `hf://`, `http(s)://`, `memory://`, `file://`)
becomes one `RemoteFile` per log file: its URL, its filesystem and its size when listed. The
readers take a RemoteFile wherever they take a local Path: `open()` is a seekable binary file that
fetches what is read (block by block, HTTP Range requests), `read_at` one byte range, so memory
stays bounded as on local files and a Parquet file is read by its footer and the column chunks
needed, never whole. Every failure of the store (no such object, 403, a refused connection,
missing credentials, a store package not installed) is one InputError naming the URL, with any
credentials in it masked.

A web server that ignores Range headers (Python's `http.server`, many static servers) answers
every ranged GET with the whole file, which fsspec either refuses mid-read or hands back as the
wrong bytes. Each http(s) file is probed once with a one-byte range away from its start; a server
that fails the probe has the file streamed once to a temporary local file, removed at exit, and
that copy is what the readers (and `--workers` processes) open, under the URL as given.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

from kvtune.errors import InputError, KvtuneError
from kvtune.masking import redact, redact_in

#: Bytes fetched per read of a remote file (one Range request each; pyarrow asks for what it needs).
BLOCK_BYTES = 4 << 20

#: The package fsspec needs for each store, named in the error when it is not installed.
PACKAGES = {
    "s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
    "abfss": "adlfs", "adl": "adlfs", "hf": "huggingface_hub", "http": "aiohttp", "https": "aiohttp",
}
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")

_T = TypeVar("_T")


def protocol(text: str) -> str | None:
    """The URL scheme of a PATH argument (`s3`, `https` …), or None for a local path."""
    m = _URL.match(text)
    return m.group(1).lower() if m else None


def describe(exc: BaseException) -> str:
    """One short phrase for a store's exception (never its traceback, never a credential)."""
    import aiohttp

    cause = _http_cause(exc)
    if cause is not None and cause is not exc:
        return describe(cause)
    if isinstance(exc, FileNotFoundError):
        return "not found (no such object, or HTTP 404)"
    if isinstance(exc, PermissionError):
        return "access denied (check the credentials for this store)"
    if isinstance(exc, aiohttp.ClientResponseError):
        return "not found (HTTP 404)" if exc.status == 404 else f"HTTP {exc.status} {exc.message}".strip()
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect to {exc.host}:{exc.port}: {exc.os_error.strerror or exc.os_error}"
    text = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    text = redact_in(text)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _http_cause(exc: BaseException) -> BaseException | None:
    """The aiohttp error behind an fsspec one (its HTTP filesystem reports a refused connection
    as FileNotFoundError raised from it), or None."""
    import aiohttp

    seen: set[int] = set()
    at: BaseException | None = exc
    while at is not None and id(at) not in seen:
        if isinstance(at, aiohttp.ClientError):
            return at
        seen.add(id(at))
        at = at.__cause__ or at.__context__
    return None


def _guarded(url: str, what: str, call: Callable[[], _T]) -> _T:
    """call(), with any store failure turned into one InputError naming the URL."""
    try:
        return call()
    except KvtuneError:
        raise
    except Exception as exc:
        raise InputError(f"{what}: {describe(exc)}", path=redact(url)) from exc


class RemoteFile:
    """One log file in a store: what `expand_paths` gives for a URL, and the readers open."""

    def __init__(self, url: str, fs: Any, fs_path: str, size: int) -> None:
        self.url = url  # as given, or as listed under a directory or glob
        self.fs = fs  # an fsspec AbstractFileSystem
        self.fs_path = fs_path  # the path in the store's own terms
        self.size = size

    @property
    def name(self) -> str:
        """The last component of the URL's path (for the container sniffed by its name)."""
        return urlsplit(self.url).path.rstrip("/").rsplit("/", 1)[-1]

    def __str__(self) -> str:
        return redact(self.url)

    def __repr__(self) -> str:
        return f"RemoteFile({str(self)!r}, size={self.size})"

    def open(self, *, readahead: bool = True) -> RemoteReader:
        """A seekable binary file over the object: read ahead BLOCK_BYTES at a time (streams), or
        fetching exactly the ranges asked for (`readahead=False`: Parquet column chunks)."""
        cache = "readahead" if readahead else "none"
        raw = _guarded(self.url, "cannot open", lambda: self.fs.open(
            self.fs_path, "rb", block_size=BLOCK_BYTES, size=self.size, cache_type=cache))
        return RemoteReader(raw, self)

    def read_range(self, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) (fewer at the end): one ranged read, safe across threads."""
        end = min(offset + length, self.size)
        if end <= offset:
            return b""
        data: bytes = _guarded(self.url, "cannot read", lambda: self.fs.cat_file(self.fs_path, start=offset, end=end))
        return data


class RemoteReader(io.RawIOBase):
    """A store's file object with its errors as InputErrors naming the URL (pyarrow reads it too)."""

    def __init__(self, raw: Any, source: RemoteFile) -> None:
        self.raw = raw
        self.source = source

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        pos: int = self.raw.seek(offset, whence)
        return pos

    def tell(self) -> int:
        pos: int = self.raw.tell()
        return pos

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        data: bytes = _guarded(self.source.url, "cannot read", lambda: self.raw.read(len(view)))
        view[: len(data)] = data
        return len(data)

    def read(self, size: int = -1) -> bytes:
        data: bytes = _guarded(self.source.url, "cannot read", lambda: self.raw.read(size))
        return data

    def close(self) -> None:
        if not self.closed:
            self.raw.close()
        super().close()


def _filesystem(text: str) -> tuple[Any, str]:
    """(fsspec filesystem, path in its terms) for a URL; a missing store package is named."""
    try:
        from fsspec.core import url_to_fs
    except ImportError:
        raise InputError("reading URLs needs fsspec: pip install fsspec", path=redact(text)) from None
    scheme = protocol(text) or ""
    try:
        fs, path = url_to_fs(text)
    except ImportError:
        package = PACKAGES.get(scheme, f"the fsspec package for {scheme}://")
        raise InputError(
            f"reading {scheme}:// needs {package}: pip install 'kvtune[remote]' (or pip install {package})",
            path=redact(text),
        ) from None
    except ValueError as exc:
        if "protocol not known" in str(exc).lower():
            raise InputError(f"unknown URL scheme {scheme}://", path=redact(text)) from None
        raise InputError(f"not a usable URL: {describe(exc)}", path=redact(text)) from exc
    except Exception as exc:  # a store's client failing to start (bad config, credentials)
        raise InputError(f"cannot reach the store: {describe(exc)}", path=redact(text)) from exc
    return fs, path


def _is_glob(path: str, scheme: str) -> bool:
    """Whether a URL's path is a pattern; over HTTP only `*` is (`?` starts the query there)."""
    if scheme in ("http", "https"):
        return "*" in urlsplit(path).path
    return any(c in path for c in "*?[")


def _visible(relative: str) -> bool:
    return not any(part.startswith(".") for part in relative.split("/") if part)


def expand_url(text: str, is_log_name: Callable[[str], bool]) -> list[RemoteFile]:
    """The log files a URL names: the object itself, a directory's log-like files (recursively,
    hidden names skipped, sorted), or a glob's matches. Matching nothing is an InputError."""
    fs, path = _filesystem(text)
    scheme = protocol(text) or ""
    if _is_glob(path, scheme):
        found: dict[str, dict[str, Any]] = _guarded(text, "cannot list", lambda: fs.glob(path, detail=True))
        root = re.split(r"[*?\[]", path, maxsplit=1)[0].rsplit("/", 1)[0]
        files: list[tuple[str, dict[str, Any]]] = []
        for name, info in sorted(found.items()):
            if not _visible(name[len(root):]):
                continue
            if info.get("type") == "directory":
                files.extend(_walk(fs, text, name, is_log_name))
            else:
                files.append((name, info))
        if not files:
            raise InputError("no files match this pattern", path=redact(text))
        return [_remote(fs, text, name, info, listed=True) for name, info in files]
    try:
        info = fs.info(path)
    except FileNotFoundError as exc:
        cause = _http_cause(exc)
        if cause is None:
            raise InputError("no such file or directory" if scheme not in ("http", "https")
                             else "not found (HTTP 404)", path=redact(text)) from None
        what = describe(cause)
        raise InputError(what if what.startswith("not found") else f"cannot read: {what}", path=redact(text)) from exc
    except Exception as exc:
        raise InputError(f"cannot read: {describe(exc)}", path=redact(text)) from exc
    if info.get("type") == "directory" or _index_page(fs, text, path, info):
        files = _walk(fs, text, path, is_log_name)
        if not files:
            raise InputError(
                "directory holds no log files (.jsonl, .json, .csv, .tsv, .parquet, optionally .gz/.zst)",
                path=redact(text),
            )
        return [_remote(fs, text, name, info, listed=True) for name, info in files]
    return [_remote(fs, text, path, info, listed=False)]


def _index_page(fs: Any, text: str, path: str, info: dict[str, Any]) -> bool:
    """Whether an HTTP URL is a directory's index page (HTML that links to files under it):
    fsspec's HTTP filesystem lists those links, so it is walked like a directory."""
    if not str(info.get("mimetype") or "").startswith("text/html"):
        return False
    found: bool = _guarded(text, "cannot list", lambda: fs.isdir(path))
    return found


def _walk(fs: Any, text: str, root: str, is_log_name: Callable[[str], bool]) -> list[tuple[str, dict[str, Any]]]:
    found: dict[str, dict[str, Any]] = _guarded(text, "cannot list", lambda: fs.find(root, detail=True))
    prefix = root.rstrip("/")
    return [
        (name, info) for name, info in sorted(found.items())
        if info.get("type") != "directory" and _visible(name[len(prefix):])
        and is_log_name(name.rstrip("/").rsplit("/", 1)[-1])
    ]


def _remote(fs: Any, text: str, name: str, info: dict[str, Any], *, listed: bool) -> RemoteFile:
    url = fs.unstrip_protocol(name) if listed else text
    size = info.get("size")
    if size is None and listed:  # a listing without sizes (links on an HTTP index page): ask the file
        size = _guarded(url, "cannot read", lambda: fs.info(name)).get("size")
    if size is None:
        raise InputError("the store gives no size for this file (no Content-Length): kvtune reads "
                         "byte ranges of it and needs its size", path=redact(url))
    if protocol(url) in ("http", "https") and not _answers_ranges(fs, url, name, int(size)):
        return _downloaded(fs, url, name)
    return RemoteFile(url, fs, name, int(size))


def _answers_ranges(fs: Any, url: str, name: str, size: int) -> bool:
    """Whether the web server answers a Range request with that range (one byte, away from the
    start: fsspec reads a whole answer from offset 0 as if it were the range)."""
    if size < 2:
        return True  # one read from the start is the whole file
    try:
        with fs.open(name, "rb", block_size=1, size=size, cache_type="none") as probe:
            probe.seek(size - 1)
            probe.read(1)
    except ValueError as exc:
        if "range requests" in str(exc):
            return False
        raise InputError(f"cannot read: {describe(exc)}", path=redact(url)) from exc
    except Exception as exc:
        raise InputError(f"cannot read: {describe(exc)}", path=redact(url)) from exc
    return True


def _downloaded(fs: Any, url: str, name: str) -> RemoteFile:
    """The file streamed once into a temporary local file (removed when kvtune exits), opened by
    the readers as the URL: for a web server without Range support."""
    import atexit  # only for a URL downloaded whole: local inputs skip these imports
    import tempfile

    from fsspec.implementations.local import LocalFileSystem

    handle, local = tempfile.mkstemp(prefix="kvtune-", suffix="-" + urlsplit(url).path.rsplit("/", 1)[-1][-64:])
    os.close(handle)
    atexit.register(_remove, local)
    try:
        _guarded(url, "cannot read", lambda: fs.get_file(name, local))
    except BaseException:
        _remove(local)
        raise
    return RemoteFile(url, LocalFileSystem(), local, os.path.getsize(local))


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
