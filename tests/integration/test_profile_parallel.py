"""`--workers N`: the profile's map step in N processes gives the bytes one process gives.

The dataset (tests/support/parallel_dataset.py): 20 files over four Hive partitions, JSONL, CSV and
Parquet, three routes (one censored), bad rows planted in files 3, 11 and 17.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from http_files import FileServer
from hypothesis import given, settings
from hypothesis import strategies as st
from parallel_dataset import BAD, FILES, ROWS_PER_FILE, write_dataset

from kvtune.cli import cli
from kvtune.ingest import IngestOptions, OnError
from kvtune.ingest.plan import FilePlan
from kvtune.ingest.readers import plan_logs
from kvtune.profile import parallel
from kvtune.profile.logs import profile_logs
from kvtune.profile.routes import Profile, merge_profiles

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    root = tmp_path_factory.mktemp("logs")
    return root, write_dataset(root)


def _cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def _saved(tmp_path: Path, name: str, *args: str) -> tuple[str, bytes]:
    out = tmp_path / f"{name}.json"
    code, stdout, stderr = _cli("profile", *args, "--json", "--quiet", "--save", str(out))
    assert code == 0, stderr
    return stdout, out.read_bytes()


def test_one_two_and_three_workers_print_and_save_the_same_bytes(dataset, tmp_path):
    root, _ = dataset
    one = _saved(tmp_path, "one", str(root), "--workers", "1")
    for n in (2, 3):
        assert _saved(tmp_path, f"w{n}", str(root), "--workers", str(n)) == one
    summary = json.loads(one[0])
    assert summary["requests"] == FILES * ROWS_PER_FILE - len(BAD)
    assert summary["skipped"]["count"] == len(BAD)
    assert [i["rows"] for i in summary["inputs"]] == [ROWS_PER_FILE] * FILES
    censored = {r["route"]: r["censored"]["count"] for r in summary["routes"]}
    assert censored["/v1/summarize"] > 0 and censored["/v1/chat/completions"] == 0


def test_the_cli_as_a_program_forks_its_workers_from_python_m_kvtune(dataset):
    """`python -m kvtune` is the main module the worker processes re-import: it must not run the
    command again in each of them."""
    root, _ = dataset

    def run(workers: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "kvtune", "profile", str(root), "--json", "--quiet",
                               "--workers", workers], capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    assert run("2") == run("1")


def test_urls_are_read_by_the_worker_processes_themselves(dataset, tmp_path):
    """A file in a store crosses to a worker as its URL and filesystem (here fsspec's HTTP one,
    against a real server on loopback), and is read there by ranges."""
    root, paths = dataset
    with FileServer(root) as server:
        urls = [f"http://127.0.0.1:{server.port}/dir/{p.relative_to(root).as_posix()}" for p in paths]
        assert _saved(tmp_path, "u2", *urls, "--workers", "2") == _saved(tmp_path, "u1", *urls, "--workers", "1")


def test_a_real_tokenizer_counts_text_in_every_worker_as_in_one_process(tmp_path):
    """Logs that carry text and no usage, counted with Mistral-7B's SentencePiece tokenizer
    (converted to tokenizer.json from the model mistral-common ships): each worker loads it."""
    from vllm_server import mistral_tokenizer_json

    records = [json.loads(line) for line in (ROOT / "sample_logs" / "openai_chat_pairs.jsonl").read_text().splitlines()]
    prose = [line for line in (ROOT / "README.md").read_text().splitlines() if len(line) > 40]
    for n, record in enumerate(records):  # real text in place of the sample's "[redacted]", no usage
        record["request"]["messages"][-1]["content"] = " ".join(prose[n % len(prose):][:1 + n % 7])
        record["response"]["choices"][0]["message"]["content"] = prose[(3 * n) % len(prose)]
        record["response"].pop("usage", None)
    logs = tmp_path / "logs"
    logs.mkdir()
    for i in range(4):
        (logs / f"part-{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[i::4]))
    tokenizer = str(mistral_tokenizer_json())
    one = _saved(tmp_path, "t1", str(logs), "--tokenizer", tokenizer, "--workers", "1")
    assert _saved(tmp_path, "t2", str(logs), "--tokenizer", tokenizer, "--workers", "2") == one
    summary = json.loads(one[0])
    assert summary["requests"] == len(records) and summary["skipped"]["count"] == 0


def test_the_first_example_of_each_skip_reason_is_the_earliest_files(dataset):
    root, paths = dataset
    one = profile_logs([str(root)], IngestOptions())
    two = profile_logs([str(root)], IngestOptions(), workers=2)
    assert list(two.skip_examples.items()) == list(one.skip_examples.items())
    assert one.skip_examples[next(iter(one.skip_examples))].startswith(f"{paths[3]}:17:")


@pytest.mark.parametrize("bad", sorted(BAD))
def test_a_bad_row_fails_naming_its_file_and_line_as_one_process_does(dataset, tmp_path, bad):
    root, paths = dataset
    # only this bad file (and the good ones before it): its error is the first one met
    keep = [str(p) for i, p in enumerate(paths) if i not in BAD or i == bad]
    errors = []
    for workers in ("1", "2", "3"):
        code, stdout, stderr = _cli("profile", *keep, "--on-error", "fail", "--quiet", "--workers", workers)
        assert code == 2 and stdout == ""
        errors.append(stderr)
    assert errors[0] == errors[1] == errors[2]
    assert f"{paths[bad]}:{BAD[bad]}:" in errors[0]
    assert "Traceback" not in errors[0] and len(errors[0].strip().splitlines()) == 1


def test_the_first_bad_file_in_input_order_is_the_one_reported(dataset):
    root, paths = dataset
    options = IngestOptions(on_error=OnError.FAIL)
    with pytest.raises(Exception) as single:
        profile_logs([str(root)], options)
    with pytest.raises(Exception) as many:
        profile_logs([str(root)], options, workers=3)
    assert type(many.value) is type(single.value) and str(many.value) == str(single.value)
    assert str(paths[3]) in str(single.value)


def test_a_parquet_file_read_in_runs_of_row_groups_names_its_bad_row_by_the_files_number(dataset, tmp_path):
    _, paths = dataset
    parquet = paths[17]
    plans, _, _ = plan_logs([str(parquet)], IngestOptions())
    tasks = parallel.split(plans, 3)
    assert [t.plan.row_groups for t in tasks] == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert _saved(tmp_path, "pq2", str(parquet), "--workers", "2") == _saved(tmp_path, "pq1", str(parquet))
    code, _, stderr = _cli("profile", str(parquet), "--on-error", "fail", "--workers", "3", "--quiet")
    assert code == 2 and f"{parquet}:{BAD[17]}: output_tokens" in stderr, stderr


def test_a_window_reports_the_same_pruned_files_and_rows_outside(dataset, tmp_path):
    root, _ = dataset
    args = (str(root), "--since", "2026-11-21T12:00", "--until", "2026-11-23T02:00")
    one = _saved(tmp_path, "win1", *args, "--workers", "1")
    assert _saved(tmp_path, "win2", *args, "--workers", "2") == one
    window = json.loads(one[0])["window"]
    assert window["pruned_files"] == 5 and window["outside_rows"] > ROWS_PER_FILE * 5  # dt=2026-11-21 and more


def test_routes_fold_once_over_the_whole_input_and_a_cap_found_in_the_trace_is_the_same(dataset, tmp_path):
    root, _ = dataset
    for args in (("--max-routes", "1"), ("--trace-max-is-cap",)):
        assert _saved(tmp_path, "f2", str(root), *args, "--workers", "2") == _saved(tmp_path, "f1", str(root), *args)
    folded = json.loads(_saved(tmp_path, "f3", str(root), "--max-routes", "1", "--workers", "3")[0])["folded"]
    assert folded["routes"] == 2


def test_recommend_and_simulate_take_workers_too(dataset, tmp_path):
    root, _ = dataset
    outs = []
    for workers in ("1", "2"):
        code, stdout, stderr = _cli("recommend", str(root), "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                                    "--json", "--workers", workers)
        assert code == 0, stderr
        outs.append(json.loads(stdout))
    assert outs[0] == outs[1]


def test_batch_api_inputs_join_across_files_so_they_are_read_in_one_process(tmp_path):
    logs = [str(ROOT / "tests" / "data" / "logs" / f"openai_batch_{kind}.jsonl") for kind in ("output", "input")]
    plans, _, _ = plan_logs(logs, IngestOptions())
    assert not parallel.parallel_safe(plans)
    one = profile_logs(logs, IngestOptions())
    assert profile_logs(logs, IngestOptions(), workers=2) == one
    assert any(r.max_tokens.total for r in one.routes)  # the join took place: max_tokens come from the inputs


def test_auto_uses_one_process_for_a_small_input(dataset):
    root, _ = dataset
    plans, _, _ = plan_logs([str(root)], IngestOptions())
    assert parallel.auto_workers(plans) == 1
    big = [replace(p, size=parallel.AUTO_MIN_BYTES) for p in plans[:1]]
    assert parallel.auto_workers(big) == max(1, parallel.usable_cores() // parallel.CORES_PER_WORKER)


@pytest.mark.parametrize(("value", "message"), [("0", "at least 1"), ("two", "expected a number or auto")])
def test_a_bad_workers_value_is_a_usage_error(dataset, value, message):
    code, _, stderr = _cli("profile", str(dataset[0]), "--workers", value)
    assert code == 2 and message in stderr


def test_a_log_path_swallowed_by_ray_is_named_as_such(dataset):
    code, _, stderr = _cli("profile", "--ray", str(dataset[0]))
    assert code == 2 and "was read as the Ray address" in stderr


# -- the split and the merge, for any shape of input


def _plan(size: int, groups: list[int], container: str = "parquet") -> FilePlan:
    return FilePlan(Path(f"f{size}.{container}"), container, None, size=size, group_rows=groups)


@settings(max_examples=200, deadline=None)
@given(files=st.lists(st.tuples(st.integers(1, 10**9), st.lists(st.integers(0, 10**6), max_size=40),
                                st.sampled_from(["parquet", "json", "csv"])), min_size=1, max_size=12),
       workers=st.integers(1, 64))
def test_split_covers_every_row_group_of_every_file_once_in_order(files, workers):
    plans = [_plan(size, groups, kind) for size, groups, kind in files]
    tasks = parallel.split(plans, workers)
    assert [t.index for t in tasks] == sorted(t.index for t in tasks)
    for index, plan in enumerate(plans):
        mine = [t for t in tasks if t.index == index]
        assert mine, "every file is read"
        if len(mine) == 1 and mine[0].plan.row_groups is None:
            continue
        runs = [t.plan.row_groups for t in mine]
        assert runs[0][0] == 0 and runs[-1][1] == len(plan.group_rows)
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(runs, runs[1:], strict=False))
        assert sum(t.weight for t in mine) <= (plan.size or 0)


def test_merging_many_profiles_at_once_equals_merging_them_in_turn(dataset):
    _, paths = dataset
    parts = [profile_logs([str(p)], IngestOptions(), max_routes=None) for p in paths[:8]]
    pairwise = Profile(routes=())
    for p in parts:
        pairwise = pairwise.merge(p)
    assert merge_profiles(parts) == pairwise
    assert json.dumps(merge_profiles(parts).to_dict()) == json.dumps(pairwise.to_dict())
