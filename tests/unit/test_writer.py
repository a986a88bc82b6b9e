"""The one writer: targets checked first, files staged, all replaced or none, errors one line."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from kvtune import writer
from kvtune.errors import InputError
from kvtune.writer import OutputFiles, write_files, write_text


def _old_set(tmp_path) -> tuple[Path, dict[str, str]]:
    out = tmp_path / "out"
    out.mkdir()
    old = {"a.txt": "old a\n", "c.txt": "old c\n"}
    for name, text in old.items():
        (out / name).write_text(text)
    return out, old


def _state(directory: Path) -> dict[str, str]:
    """Every entry of a directory: file contents, or what kind of thing it is."""
    found = {}
    for p in sorted(directory.iterdir()):
        found[p.name] = (f"-> {os.readlink(p)}" if p.is_symlink() else p.read_text() if p.is_file()
                         else "dir" if p.is_dir() else "special")
    return found


def _make(kind: str, path: Path) -> None:
    if kind == "directory":
        path.mkdir()
    elif kind == "FIFO":
        os.mkfifo(path)
    elif kind == "symbolic link":
        path.symlink_to(path.parent / "a.txt")
    elif kind == "dangling link":
        path.symlink_to(path.parent / "nowhere")
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()


@pytest.mark.parametrize("kind, word", [
    ("directory", "a directory"), ("FIFO", "a FIFO"), ("symbolic link", "a symbolic link"),
    ("dangling link", "a symbolic link"), ("socket", "a socket"),
])
def test_a_non_regular_target_is_refused_before_anything_is_written(tmp_path, kind, word):
    out, _ = _old_set(tmp_path)
    _make(kind, out / "b.txt")
    before = _state(out)
    with pytest.raises(InputError, match=f"refusing to replace {word} with a file") as caught:
        write_files({out / "a.txt": "new a\n", out / "b.txt": "new b\n", out / "c.txt": "new c\n"})
    assert caught.value.path == str(out / "b.txt") and "\n" not in str(caught.value)
    assert _state(out) == before  # old files, the special entry as it was, no staging left


def test_a_device_target_is_refused(tmp_path, private_device):
    device = private_device(tmp_path)
    with pytest.raises(InputError, match="refusing to replace a character device"):
        write_text(device, "x")
    assert stat.S_ISCHR(os.lstat(device).st_mode)


def test_a_failed_rename_puts_the_previous_files_back(tmp_path, monkeypatch):
    """The second of three renames fails: the first target is restored from its backup, the new
    one (b.txt did not exist) is removed again, and the error names the file."""
    out, old = _old_set(tmp_path)
    real_replace = os.replace
    calls = []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(errno.EIO, "Input/output error")
        return real_replace(src, dst)

    monkeypatch.setattr(writer.os, "replace", replace)
    with pytest.raises(InputError) as caught:
        write_files({out / "a.txt": "new a\n", out / "b.txt": "new b\n", out / "c.txt": "new c\n"})
    assert str(caught.value) == f"{out / 'b.txt'}: cannot replace: Input/output error"
    assert _state(out) == old


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT])
def test_an_oserror_while_staging_is_one_line_naming_the_file(tmp_path, monkeypatch, code):
    """Injected at the production seam (the staged file's write), for one call."""
    out, old = _old_set(tmp_path)
    real_fdopen = os.fdopen
    opened = []

    class Failing:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            raise OSError(code, os.strerror(code))

        def __getattr__(self, name):
            return getattr(self.f, name)

    def fdopen(fd, *args, **kwargs):
        f = real_fdopen(fd, *args, **kwargs)
        opened.append(f)
        return Failing(f) if len(opened) == 2 else f

    monkeypatch.setattr(writer.os, "fdopen", fdopen)
    with pytest.raises(InputError) as caught:
        write_files({out / "a.txt": "new a\n", out / "b.txt": "new b\n"})
    assert str(caught.value) == f"{out / 'b.txt'}: cannot write: {os.strerror(code)}"
    assert _state(out) == old


def test_proc_and_a_file_for_a_directory_are_one_line(tmp_path):
    with pytest.raises(InputError, match="^/proc/kvtune-test: cannot create the directory"):
        write_text("/proc/kvtune-test/x.json", "x")
    with pytest.raises(InputError, match="^/proc/self/status: cannot"):
        write_text("/proc/self/status", "x")
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="not a directory|Not a directory"):
        write_text(tmp_path / "file" / "x.json", "x")
    assert (tmp_path / "file").read_text() == "x"


def test_new_directories_are_made_and_removed_again_when_nothing_is_written(tmp_path):
    (tmp_path / "dir").mkdir()
    target = tmp_path / "new" / "deeper" / "x.json"
    with pytest.raises(InputError):
        write_files({target: "x", tmp_path / "dir": "y"})
    assert not (tmp_path / "new").exists()
    assert write_text(target, "x") == target and target.read_text() == "x"


def test_modes_kept_on_replace_and_new_files_follow_the_umask(tmp_path):
    keep = tmp_path / "private.json"
    keep.write_text("old")
    keep.chmod(0o600)
    old_umask = os.umask(0o022)
    try:
        write_files({keep: "new", tmp_path / "run.sh": "#!/bin/sh\n", tmp_path / "plain.txt": "x"},
                    executable=[tmp_path / "run.sh"])
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(keep.stat().st_mode) == 0o600 and keep.read_text() == "new"
    assert stat.S_IMODE((tmp_path / "run.sh").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.txt", "private.json", "run.sh"]


def test_a_streamed_file_commits_with_the_rest_or_not_at_all(tmp_path):
    log, out = tmp_path / "requests.jsonl", tmp_path / "results.json"
    with OutputFiles() as files:
        stream = files.open(log)
        stream.write("line 1\n")
        assert not log.exists()  # staged, not yet in place
    assert not log.exists() and list(tmp_path.iterdir()) == []  # left without commit: discarded
    with OutputFiles() as files:
        files.open(log).write("line 1\n")
        files.write(out, "{}\n")
        assert files.commit() == [log, out]
    assert log.read_text() == "line 1\n" and out.read_text() == "{}\n"
    with OutputFiles() as files, pytest.raises(InputError, match="given twice"):
        files.open(log)
        files.write(log, "x")


def _isolated_mounts_available() -> bool:
    if sys.platform != "linux" or shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True)
    return probe.returncode == 0


_ON_SMALL_MOUNTS = """
set -e
mount -t tmpfs -o size=64k tmpfs "$1/full"
mount -t tmpfs -o ro tmpfs "$1/ro"
head -c 60000 /dev/zero > "$1/full/filler"
echo old > "$1/full/profile.json"
cd {repo}
for target in "$1/full/profile.json" "$1/ro/profile.json"; do
    {python} -m kvtune profile tests/data/logs/kvtune.jsonl --json --save "$target" > /dev/null 2>> "$1/errors" \\
        && echo "exit 0" >> "$1/errors" || echo "exit $?" >> "$1/errors"
done
cat "$1/full/profile.json" >> "$1/errors"
ls -A "$1/full" "$1/ro" >> "$1/errors"
"""


@pytest.mark.skipif(not _isolated_mounts_available(), reason="needs root and unshare to mount a tmpfs")
def test_a_full_disk_and_a_read_only_filesystem_for_real(tmp_path):
    """`profile --save` onto a 64 KiB tmpfs that is nearly full (ENOSPC) and onto a read-only
    one (EROFS), in a private mount namespace: exit 2 with one line each, the old file intact,
    nothing left behind. (A big profile does not fit where the small old one did.)"""
    (tmp_path / "full").mkdir()
    (tmp_path / "ro").mkdir()
    # a profile larger than the room left: many routes
    script = _ON_SMALL_MOUNTS.format(repo=REPO, python=sys.executable)
    big = tmp_path / "many.jsonl"
    big.write_text("".join(f'{{"route": "/r{i}", "output_tokens": {i}}}\n' for i in range(3000)))
    script = script.replace("tests/data/logs/kvtune.jsonl", str(big))
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = (tmp_path / "errors").read_text().splitlines()
    assert lines[0] == f"Error: {tmp_path}/full/profile.json: cannot write: No space left on device"
    assert lines[1] == "exit 2"
    assert lines[2].startswith(f"Error: {tmp_path}/ro/profile.json: cannot write: Read-only file system")
    assert lines[3] == "exit 2"
    assert lines[4] == "old"  # the previous file, untouched
    assert lines[5:] == [f"{tmp_path}/full:", "filler", "profile.json", "", f"{tmp_path}/ro:"]
