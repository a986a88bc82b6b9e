"""`--ray [ADDRESS]`: the profile's map step as tasks on a real Ray cluster (`ray start --head`,
2 CPUs, on loopback), byte-identical to one process: with bad rows, a censored route, a worker
killed in the middle of a task, and `--log-model`'s selection made in each task.

The dataset is tests/support/parallel_dataset.py's: 20 files over four partitions, bad rows in files 3,
11 and 17.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import mixed_models
import pytest
from http_files import FileServer
from parallel_dataset import BAD, write_dataset

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RAY = Path(sys.executable).with_name("ray")
# a cluster on loopback for this test only: no usage report, no token to hand to the client
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    root = tmp_path_factory.mktemp("logs")
    return root, write_dataset(root)


def _kvtune(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtune", *args], capture_output=True, text=True, cwd=ROOT,
                          env=ENV, timeout=timeout)


@pytest.fixture(scope="module")
def single(dataset) -> str:
    proc = _kvtune("profile", str(dataset[0]), "--json", "--quiet", "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_without_an_address_a_local_cluster_is_started_and_stopped(dataset, single):
    """Runs before the module's cluster starts: with no address, Ray starts one of its own."""
    proc = _kvtune("profile", str(dataset[0]), "--json", "--quiet", "--ray")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == single
    assert "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def cluster() -> str:
    port = _free_port()
    subprocess.run([str(RAY), "start", "--head", "--num-cpus", "2", "--port", str(port), "--include-dashboard=false",
                    "--disable-usage-stats", "--node-ip-address", "127.0.0.1"],
                   env=ENV, check=True, capture_output=True, timeout=180)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([str(RAY), "stop", "--force"], env=ENV, capture_output=True, timeout=120)


def test_a_cluster_gives_the_bytes_of_one_process_printed_and_saved(dataset, single, cluster, tmp_path):
    saved = tmp_path / "ray.json"
    proc = _kvtune("profile", str(dataset[0]), "--json", "--quiet", "--save", str(saved), f"--ray={cluster}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == single
    local = tmp_path / "one.json"
    assert _kvtune("profile", str(dataset[0]), "--quiet", "--save", str(local), "--workers", "1").returncode == 0
    assert saved.read_bytes() == local.read_bytes()
    summary = json.loads(proc.stdout)
    assert summary["skipped"]["count"] == len(BAD)
    assert any(r["censored"]["count"] for r in summary["routes"])


def test_the_selection_happens_in_each_ray_task_with_the_same_bytes_as_one_process(cluster, tmp_path):
    """tests/support/mixed_models.py's two-model log in three files: `--log-model` is applied in
    every task on the cluster, as in one process (moved here from test_cli_log_model.py to run on
    this module's cluster instead of starting a local one of its own: the start was ~1 min of CPU)."""
    mixed_models.write_parts(tmp_path / "logs", parts=3)

    def profile(*extra: str) -> str:
        proc = _kvtune("profile", str(tmp_path / "logs"), "--json", "-q", "--log-model", mixed_models.QWEN, *extra)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    assert profile(f"--ray={cluster}") == profile("--workers", "1")


def test_workers_read_urls_themselves_with_ranged_reads(dataset, cluster):
    """Inputs in a store (here fsspec's HTTP filesystem against a real server on loopback, which
    answers Range requests): each Ray task opens its own URL where it runs, and the merged output
    is one process's."""
    root, paths = dataset
    with FileServer(root) as server:
        urls = [f"http://127.0.0.1:{server.port}/dir/{p.relative_to(root).as_posix()}" for p in paths]
        one = _kvtune("profile", *urls, "--json", "--quiet", "--workers", "1")
        ray = _kvtune("profile", *urls, "--json", "--quiet", f"--ray={cluster}")
    assert one.returncode == ray.returncode == 0, ray.stderr
    assert ray.stdout == one.stdout
    summary = json.loads(ray.stdout)
    assert [i["path"] for i in summary["inputs"]] == urls and summary["skipped"]["count"] == len(BAD)


def test_a_bad_row_on_a_worker_is_named_by_its_file_and_line(dataset, cluster):
    root, paths = dataset
    args = ("profile", str(root), "--on-error", "fail", "--quiet")
    ray = _kvtune(*args, "--ray", cluster)
    one = _kvtune(*args, "--workers", "1")
    assert ray.returncode == one.returncode == 2
    assert ray.stdout == ""
    assert ray.stderr.strip().splitlines()[-1] == one.stderr.strip().splitlines()[-1]
    assert f"{paths[3]}:{BAD[3]}:" in one.stderr
    assert "Traceback" not in ray.stderr


def _running_tasks() -> list[int]:
    """Ray worker processes running a profile task now (Ray titles a busy worker ray::FUNCTION)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if title.startswith(b"ray::profile_part"):
            found.append(int(entry.name))
    return found


def test_a_worker_killed_mid_task_is_retried_and_the_result_is_the_same(dataset, single, cluster):
    proc = subprocess.Popen([sys.executable, "-m", "kvtune", "profile", str(dataset[0]), "--json", "--quiet",
                             "--ray", cluster], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=ENV)
    killed = None
    deadline = time.monotonic() + 120
    while killed is None and proc.poll() is None and time.monotonic() < deadline:
        for pid in _running_tasks():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            killed = pid
            break
        time.sleep(0.002)
    stdout, stderr = proc.communicate(timeout=180)
    assert killed is not None, "no profile task was seen running"
    assert proc.returncode == 0, stderr
    assert "will be retried" in stderr  # Ray's word that the killed task ran again; stdout holds only the JSON
    assert stdout == single


def test_an_address_where_no_cluster_listens_is_one_line_at_once(dataset):
    start = time.monotonic()
    proc = _kvtune("profile", str(dataset[0]), "--quiet", "--ray", f"127.0.0.1:{_free_port()}")
    assert proc.returncode == 2
    assert "cannot join the Ray cluster at 127.0.0.1:" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert time.monotonic() - start < 30


def test_exclude_and_kvtune_outputs_are_left_out_on_a_cluster_as_in_one_process(dataset, cluster, tmp_path):
    """--exclude and the files kvtune wrote are decided where the inputs are planned, before any
    task: a cluster reads the same files as one process and reports the same files not read."""
    root, paths = dataset
    logs = tmp_path / "logs"
    shutil.copytree(root, logs)
    saved = _kvtune("profile", str(logs), "--quiet", "--workers", "1", "--save", str(logs / "week.json"))
    assert saved.returncode == 0, saved.stderr
    skip = paths[0].relative_to(root).as_posix()
    args = ("profile", str(logs), "--json", "--quiet", "--exclude", skip)
    one = _kvtune(*args, "--workers", "1")
    ray = _kvtune(*args, f"--ray={cluster}")
    assert one.returncode == ray.returncode == 0, ray.stderr
    assert ray.stdout == one.stdout
    summary = json.loads(ray.stdout)
    assert summary["skipped_files"] == [{"path": str(logs / skip), "reason": f"--exclude {skip}"},
                                        {"path": str(logs / "week.json"),
                                         "reason": "kvtune's own output: written by kvtune profile --save"}]
