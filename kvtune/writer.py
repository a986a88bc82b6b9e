"""Writing output files all or nothing: the one writer behind every file a command writes.

`write_files({path: text, ...})` (recommend --out, profile --save, calibrate --save) and
`OutputFiles` (the same, filled while a command runs: bench's --requests-log streams into its
staged file, --out joins it at the end) work in three steps:

1. check every target before anything is written: it must be absent or a regular file. A
   directory, FIFO, device, socket or symbolic link is refused (replacing it with a file would
   change what it is; writing into a FIFO or a device would never end);
2. stage every file in a hidden directory beside its target (same filesystem, so renames are
   atomic), written and fsynced there;
3. replace: each existing target is hard-linked into the staging directory as a backup, then
   every staged file is renamed over its target; if a rename fails part way, the targets already
   replaced are put back from the backups, so the set on disk is the old one or the new one.

Any OSError (ENOSPC, EROFS, EACCES, /proc) is one InputError naming the path. A replaced file
keeps the permission bits of the one it replaces; a new one gets 0o666 (0o777 when executable)
less the umask.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from kvtune.errors import InputError

__all__ = ["OutputFiles", "check_target", "write_files", "write_text"]

_NOT_REGULAR = (
    (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
)
_STAGING_PREFIX = ".kvtune-staging-"


def _error(path: str | os.PathLike[str], exc: OSError, doing: str = "write") -> InputError:
    return InputError(f"cannot {doing}: {exc.strerror or exc}", path=str(path))


def check_target(path: str | os.PathLike[str]) -> os.stat_result | None:
    """The stat of `path` if it is a regular file, None if it is absent; InputError for anything
    else (a symbolic link is refused whatever it points to: kvtune would replace the link)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    except NotADirectoryError as exc:  # a file where a directory should be: name that one
        parent = next((p for p in Path(path).parents if os.path.lexists(p)), Path(path).parent)
        raise InputError("not a directory: the files cannot be written into it", path=str(parent)) from exc
    except OSError as exc:  # ELOOP, EACCES
        raise _error(path, exc) from exc
    if stat.S_ISREG(info.st_mode):
        return info
    kind = next((name for test, name in _NOT_REGULAR if test(info.st_mode)), "not a regular file")
    raise InputError(f"refusing to replace {kind} with a file: remove it or choose another path", path=str(path))


class _Stream:
    """A staged text file a command writes into as it runs: an OSError (a full disk) is an
    InputError naming the target, like every other write."""

    def __init__(self, file: IO[str], target: Path) -> None:
        self.file = file
        self.target = target

    def write(self, text: str) -> int:
        try:
            return self.file.write(text)
        except OSError as exc:
            raise _error(self.target, exc) from exc

    def flush(self) -> None:
        try:
            self.file.flush()
        except OSError as exc:
            raise _error(self.target, exc) from exc

    def fileno(self) -> int:
        return self.file.fileno()

    @property
    def closed(self) -> bool:
        return self.file.closed

    def close(self) -> None:
        self.file.close()


@dataclass
class _Staged:
    target: Path
    staged: Path
    executable: bool
    stream: _Stream | None = None  # open while a command writes into it (OutputFiles.open)


class OutputFiles:
    """Files to write together: each staged when added (its target checked then), all replaced
    by `commit()`, or none. Leaving a `with` block without committing discards them."""

    def __init__(self) -> None:
        self._files: dict[str, _Staged] = {}
        self._staging: dict[str, Path] = {}  # target directory -> its staging directory
        self._made: list[Path] = []  # directories created for targets, removed again if unused
        self._closed = False

    def __enter__(self) -> OutputFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()

    def write(self, path: str | os.PathLike[str], text: str, *, executable: bool = False) -> None:
        """Stage `text` for `path`."""
        entry = self._stage(path, executable)
        try:
            with self._create(entry) as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            raise _error(entry.target, exc) from exc

    def open(self, path: str | os.PathLike[str]) -> _Stream:
        """A text file staged for `path`, to write into as the command runs; `commit` syncs it."""
        entry = self._stage(path, False)
        try:
            entry.stream = _Stream(self._create(entry), entry.target)
        except OSError as exc:
            raise _error(entry.target, exc) from exc
        return entry.stream

    def commit(self) -> list[Path]:
        """Replace every target with its staged file, all or none; returns the targets."""
        if self._closed:
            raise RuntimeError("these files were already committed or discarded")
        entries = list(self._files.values())
        try:
            for entry in entries:
                if entry.stream is not None:
                    try:
                        entry.stream.file.flush()
                        os.fsync(entry.stream.fileno())
                        entry.stream.close()
                    except OSError as exc:
                        raise _error(entry.target, exc) from exc
            found = [check_target(entry.target) for entry in entries]  # again: any may have changed since
            backups = {}
            for entry, info in zip(entries, found, strict=True):
                if info is not None:
                    try:
                        os.chmod(entry.staged, stat.S_IMODE(info.st_mode))
                    except OSError as exc:
                        raise _error(entry.target, exc) from exc
                    backups[entry.target] = self._backup(entry)
            self._replace(entries, backups)
            for directory in self._staging:
                _fsync_directory(directory)
        finally:
            self.discard()
        return [entry.target for entry in entries]

    def discard(self) -> None:
        """Forget every staged file: targets untouched, staging directories removed."""
        if self._closed:
            return
        self._closed = True
        for entry in self._files.values():
            if entry.stream is not None and not entry.stream.closed:
                try:
                    entry.stream.close()
                except OSError:  # a full disk refusing the last buffer: the file is dropped anyway
                    pass
        for staging in self._staging.values():
            shutil.rmtree(staging, ignore_errors=True)
        for directory in reversed(self._made):
            try:
                directory.rmdir()  # only if still empty: nothing was committed into it
            except OSError:
                pass

    # -- the steps

    def _stage(self, path: str | os.PathLike[str], executable: bool) -> _Staged:
        if self._closed:
            raise RuntimeError("these files were already committed or discarded")
        target = Path(path)
        key = os.path.abspath(target)
        if key in self._files:
            raise InputError("the same output file is given twice", path=str(target))
        check_target(target)
        directory = target.parent
        staging = self._staging.get(os.path.abspath(directory))
        if staging is None:
            self._make_directory(directory)
            try:
                staging = Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=directory))
            except OSError as exc:
                raise _error(target, exc) from exc
            self._staging[os.path.abspath(directory)] = staging
        entry = _Staged(target, staging / target.name, executable)
        self._files[key] = entry
        return entry

    def _make_directory(self, directory: Path) -> None:
        missing = []
        for parent in (directory, *directory.parents):
            if os.path.lexists(parent):
                break
            missing.append(parent)
        for parent in reversed(missing):
            try:
                parent.mkdir()
            except FileExistsError:
                continue
            except OSError as exc:
                raise _error(parent, exc, "create the directory") from exc
            self._made.append(parent)
        if not directory.is_dir():
            raise InputError("not a directory: the files cannot be written into it", path=str(directory))

    @staticmethod
    def _create(entry: _Staged) -> IO[str]:
        fd = os.open(entry.staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o777 if entry.executable else 0o666)
        return os.fdopen(fd, "w", encoding="utf-8", newline="\n")

    def _backup(self, entry: _Staged) -> Path:
        """A hard link to the current target in the staging directory (a copy where the
        filesystem has no hard links), to put it back if a later rename fails."""
        backup = entry.staged.with_name(entry.staged.name + ".previous")
        try:
            os.link(entry.target, backup, follow_symlinks=False)
        except OSError:
            try:
                shutil.copy2(entry.target, backup, follow_symlinks=False)
            except OSError as exc:
                raise _error(entry.target, exc, "keep a backup of") from exc
        return backup

    def _replace(self, entries: list[_Staged], backups: dict[Path, Path]) -> None:
        done: list[_Staged] = []
        for entry in entries:
            try:
                os.replace(entry.staged, entry.target)
            except OSError as exc:
                failed = self._restore(done, backups)
                if failed:  # keep the staging directories: they hold the only copies of those files
                    kept = sorted({str(backups[Path(t)].parent) for t in failed if Path(t) in backups})
                    self._staging = {}
                    raise InputError(
                        f"cannot replace: {exc.strerror or exc}; nor put back {', '.join(failed)}"
                        + (f" (the previous versions are in {', '.join(kept)})" if kept else ""),
                        path=str(entry.target)) from exc
                raise _error(entry.target, exc, "replace") from exc
            done.append(entry)

    @staticmethod
    def _restore(done: list[_Staged], backups: dict[Path, Path]) -> list[str]:
        """Undo the renames already made; returns the targets that could not be put back."""
        failed = []
        for entry in reversed(done):
            try:
                if entry.target in backups:
                    os.replace(backups[entry.target], entry.target)
                else:
                    os.unlink(entry.target)
            except OSError:
                failed.append(str(entry.target))
        return failed


def _fsync_directory(directory: str) -> None:
    """Make the renames in a directory durable (best effort: some filesystems refuse)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_files(files: Mapping[str | os.PathLike[str], str], *, executable: Collection[str | os.PathLike[str]] = ()
                ) -> list[Path]:
    """Write every file or none (see the module docstring); `executable`: targets made executable."""
    runnable = {os.path.abspath(p) for p in executable}
    with OutputFiles() as out:
        for path, text in files.items():
            out.write(path, text, executable=os.path.abspath(path) in runnable)
        return out.commit()


def write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write one file so that a failure leaves the previous one (or none) in place."""
    return write_files({path: text})[0]
