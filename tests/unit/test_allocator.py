"""kvtune.allocator: glibc's malloc thresholds are set once for commands that read logs."""

import platform
import subprocess
import sys

import pytest

from kvtune.allocator import tune_for_streaming


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's")
def test_tunes_glibc_once_and_reading_logs_asks_for_it():
    assert tune_for_streaming() is True
    assert tune_for_streaming() is True  # idempotent
    # the CLI path that builds IngestOptions tunes the process before it reads anything
    code = (
        "import kvtune.allocator as a; from kvtune.cli.options import LogArgs; "
        "assert not a._tuned; LogArgs(None, (), None, None, 'skip', False, None, 2000).ingest(); assert a._tuned"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
