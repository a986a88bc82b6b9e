"""Compressed log files: gzip and zstd (multi-member), recognised by magic bytes, not by name."""

from __future__ import annotations

import io
import os
import zlib
from pathlib import Path
from typing import Any, Literal, Protocol, TypeAlias

from kvtune.errors import InputError
from kvtune.ingest.remote import RemoteFile

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

#: A file's compression, by magic bytes, in DuckDB's words for it (`read_json(compression=...)`).
Codec = Literal["gzip", "zstd", "none"]


class _Decompressor(Protocol):
    """One gzip member or zstd frame being decompressed: zlib's and zstandard's decompressobj."""

    def decompress(self, data: bytes, /) -> bytes: ...

    @property
    def eof(self) -> bool: ...

    @property
    def unused_data(self) -> bytes: ...


class _Decompressed(io.RawIOBase):
    """Decompressed bytes of a gzip or zstd file (multi-member), failing loudly on truncation.

    `raw.tell()` gives the compressed position for progress.
    """

    _d: _Decompressor  # the member or frame being read

    def __init__(self, raw: io.BufferedReader[_Sized], codec: Codec, path: str) -> None:
        self.raw = raw
        self.codec = codec
        self.path = path
        self._buf = b""
        self._pos = 0
        self._done = False
        self._new()

    def _new(self) -> None:
        if self.codec == "gzip":
            self._d = zlib.decompressobj(wbits=31)
        else:
            import zstandard

            self._d = zstandard.ZstdDecompressor().decompressobj()

    def readable(self) -> bool:
        return True

    def _fill(self) -> None:
        data = self.raw.read(1 << 20)
        if not data:
            if not self._d.eof:
                raise InputError(
                    f"truncated {self.codec} file: the compressed stream ends early", path=self.path
                )
            self._done = True
            return
        try:
            out = self._d.decompress(data)
            while self._d.eof and self._d.unused_data:  # next gzip member / zstd frame
                rest = self._d.unused_data
                self._new()
                out += self._d.decompress(rest)
        except Exception as exc:  # zlib.error, zstandard.ZstdError
            raise InputError(f"corrupt {self.codec} data: {exc}", path=self.path) from exc
        self._buf, self._pos = out, 0

    def readinto(self, b: Any) -> int:
        while self._pos >= len(self._buf) and not self._done:
            self._fill()
        n = min(len(b), len(self._buf) - self._pos)
        b[:n] = self._buf[self._pos : self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self.raw.close()
        super().close()


def _codec(magic: bytes) -> Codec:
    if magic.startswith(GZIP_MAGIC):
        return "gzip"
    if magic.startswith(ZSTD_MAGIC):
        return "zstd"
    return "none"


def compression_of(path: Path) -> Codec:
    """"gzip", "zstd" or "none", by magic bytes (DuckDB's names for them)."""
    with open(path, "rb") as f:
        return _codec(f.read(4))


class _Sized(io.RawIOBase):
    """A plain file read as it was when first seen (`size` bytes), failing loudly if it shrinks.

    A log rotated by copytruncate while kvtune reads it ends early: reading reaches the new end
    before `size`, and that is an InputError naming the file, not a silently partial profile.
    Bytes appended meanwhile are not read, so every pass over a file sees the same rows.
    """

    def __init__(self, path: Path | RemoteFile, size: int | None) -> None:
        self.path = str(path)
        self.remote = path if isinstance(path, RemoteFile) else None
        self.file: io.FileIO | io.RawIOBase
        if isinstance(path, RemoteFile):  # an object in a store: ranged reads, its size as listed
            self.file = path.open()
            self.size = path.size if size is None else size
        else:
            self.file = io.FileIO(path, "rb")
            self.size = os.fstat(self.file.fileno()).st_size if size is None else size
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.file.fileno()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = self.file.seek(offset, whence)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b: Any) -> int:
        want = min(len(b), self.size - self.pos)
        if want <= 0:
            return 0
        view = memoryview(b).cast("B")
        n = self.file.readinto(view[:want]) or 0
        self.pos += n
        if n < want:  # a regular file reads short only at its end: has it shrunk?
            if self.remote is not None:
                if n == 0:
                    _remote_shrunk(self.path, self.size, self.pos)
            else:
                check_not_shrunk(self.path, self.size, os.fstat(self.file.fileno()).st_size)
        return n

    def read_at(self, offset: int, buf: Any) -> int:
        """Fill `buf` from `offset` without moving the position (pread: threads may read at once);
        short only at the end of the file as planned."""
        view = memoryview(buf).cast("B")[: max(0, min(len(buf), self.size - offset))]
        if self.remote is not None:  # one ranged read (a Range request over HTTP), thread-safe
            data = self.remote.read_range(offset, len(view))
            view[: len(data)] = data
            if len(data) < len(view):
                _remote_shrunk(self.path, self.size, offset + len(data))
            return len(data)
        got = 0
        while got < len(view):
            n = _pread_into(self.file.fileno(), view[got:], offset + got)
            if n == 0:
                check_not_shrunk(self.path, self.size, os.fstat(self.file.fileno()).st_size)
                break
            got += n
        return got

    def close(self) -> None:
        self.file.close()
        super().close()


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """preadv into `view` (no copy), or pread and a copy where the platform has no preadv."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    data = os.pread(fd, len(view), offset)
    view[: len(data)] = data
    return len(data)


def _remote_shrunk(url: str, size: int, at: int) -> None:
    raise InputError(f"ends at byte {at:,} but was listed as {size:,} bytes: replaced while being read?", path=url)


def check_not_shrunk(path: str | Path, size: int, now: int | None = None) -> None:
    """InputError when a file read as `size` bytes is now shorter (default: stat it now)."""
    if now is None:
        try:
            now = os.stat(path).st_size
        except OSError as exc:  # removed or replaced while being read
            raise InputError(f"cannot read: {exc.strerror or exc} (moved while being read?)", path=str(path)) from exc
    if now < size:
        raise InputError(
            f"truncated while being read (was {size:,} bytes, now {now:,}): a log rotated with "
            "copytruncate? Profile the rotated copy, not the live file",
            path=str(path),
        )


#: A file's bytes as `open_bytes` reads them: plain (the raw file itself), or decompressed.
Stream: TypeAlias = "io.BufferedReader[_Sized] | io.BufferedReader[_Decompressed]"  # not generic at runtime


def open_bytes(path: Path | RemoteFile, size: int | None = None) -> tuple[Stream, io.BufferedReader[_Sized]]:
    """(decompressed binary stream, raw file) for a plain, gzip or zstd file, by magic bytes.

    `size`: the file's size when it was planned (default: now); reading stops there, and a file
    found shorter than that is an InputError (see `_Sized`).
    """
    try:
        raw = io.BufferedReader(_Sized(path, size), 1 << 20)
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", path=str(path)) from exc
    codec = _codec(raw.read(4))
    raw.seek(0)
    if codec == "none":
        return raw, raw
    return io.BufferedReader(_Decompressed(raw, codec, str(path)), 1 << 20), raw
