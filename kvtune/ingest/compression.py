"""Compressed log files: gzip and zstd (multi-member), recognised by magic bytes, not by name."""

from __future__ import annotations

import io
import zlib
from pathlib import Path
from typing import Any

from kvtune.errors import InputError

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


class _Decompressed(io.RawIOBase):
    """Decompressed bytes of a gzip or zstd file (multi-member), failing loudly on truncation.

    `raw.tell()` gives the compressed position for progress.
    """

    def __init__(self, raw: Any, codec: str, path: str) -> None:
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


def _codec(magic: bytes) -> str:
    if magic.startswith(GZIP_MAGIC):
        return "gzip"
    if magic.startswith(ZSTD_MAGIC):
        return "zstd"
    return "none"


def compression_of(path: Path) -> str:
    """"gzip", "zstd" or "none", by magic bytes (DuckDB's names for them)."""
    with open(path, "rb") as f:
        return _codec(f.read(4))


def open_bytes(path: Path) -> tuple[Any, Any]:
    """(decompressed binary stream, raw file) for a plain, gzip or zstd file, by magic bytes."""
    try:
        raw = open(path, "rb")  # noqa: SIM115 - closed by the caller
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", path=str(path)) from exc
    codec = _codec(raw.read(4))
    raw.seek(0)
    if codec == "none":
        return raw, raw
    return io.BufferedReader(_Decompressed(raw, codec, str(path)), 1 << 20), raw
