"""The Recommendation document: recommendation.json written by `recommend` and read back strictly
by `check`, `bench --expect` and the API, so a damaged file is one error line that names the field,
never a traceback or a detour through the log readers (issue #10 items 10-11, #11)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtune.cli import cli
from kvtune.errors import InputError
from kvtune.policy.recommendation import load_recommendation, read_recommendation

DATA = Path(__file__).parents[1] / "data"
GOOD = json.loads((DATA / "recommendation.json").read_text())
GATEWAY = {"version": 1, "upstream": "http://127.0.0.1:8000", "block_size": 16, "block_budget": 26999,
           "max_model_len": 14512, "routes": [{"name": "default", "max_new_tokens": 700}]}


UPSTREAM = {"url": "http://10.0.0.7:8000", "block_budget": 1799, "num_blocks": 2000, "capacity_file": "a.json"}


def parse_recommendation(data, *, path):
    return read_recommendation(data, path=path)


def damaged(edit) -> dict:
    rec = copy.deepcopy(GOOD)
    edit(rec)
    return rec


@pytest.mark.parametrize("edit, field, words", [
    (lambda r: r.pop("settings"), "settings", "missing"),
    (lambda r: r["settings"].pop("max_model_len"), "settings.max_model_len", "missing"),
    (lambda r: r["settings"]["max_model_len"].update(value=None), "settings.max_model_len.value", "expected an integer, got null"),
    (lambda r: r["routes"][0]["max_new_tokens"].update(value="many"), "routes[0].max_new_tokens.value",
     "expected an integer, got 'many'"),
    (lambda r: r["routes"][0]["max_new_tokens"].update(value=2**70), "routes[0].max_new_tokens.value",
     "must be at most 9007199254740992"),
    (lambda r: r["routes"][0].update(match=5), "routes[0].match", "expected an object, got 5"),
    (lambda r: r["routes"][0].update(prompt_tokens=[]), "routes[0].prompt_tokens", "expected an object"),
    (lambda r: r["routes"][0]["output_histogram"].update(edges=[0]), "routes[0].output_histogram",
     "increasing edges"),
    (lambda r: r["routes"][0].update(truncation_share="NaN"), "routes[0].truncation_share",
     "expected a number, got 'NaN'"),
    (lambda r: r.update(routes=[]), "routes", "non-empty list"),
    (lambda r: r["capacity"].update(block_size=0), "capacity.block_size", "must be at least 1, got 0"),
    (lambda r: r["capacity"].update(num_blocks=True), "capacity.num_blocks", "expected an integer, got True"),
    (lambda r: r.update(engine=[]), "engine", "expected an object"),
    (lambda r: r["engine"].update(v1="yes"), "engine.v1", "expected true or false"),
    (lambda r: r["hardware"].update(gpu_memory_bytes=-1), "hardware.gpu_memory_bytes", "must be at least 1, got -1"),
    (lambda r: r["settings"]["gpu_memory_utilization"].update(value=9.2), "settings.gpu_memory_utilization.value",
     "must be at most 1, got 9.2"),
    (lambda r: r["settings"].update(max_num_seqs=7), "settings.max_num_seqs", "expected an object"),
    (lambda r: r["settings"].update(max_batch=7), "settings.max_batch", "unknown setting"),
    (lambda r: r.update(schema_version=True), "schema_version", "expected an integer"),
    (lambda r: r.update(schema_version=1), "schema_version", "written by an older kvtune"),
    (lambda r: r["routes"][0].pop("output_lengths"), "routes[0].output_lengths", "missing"),
    (lambda r: r["routes"][0]["output_lengths"]["censored"].update(counts=[-1]),
     "routes[0].output_lengths.censored.counts", ""),
    (lambda r: r["routes"][0].update(tail="medium"), "routes[0].tail", "is not one of light, heavy"),
    (lambda r: r["capacity"].update(source="guess"), "capacity.source", "is not one of"),
    (lambda r: r["concurrency"].update(context_tokens="x" * 10_000), "concurrency.context_tokens", "..."),
    (lambda r: r.update(upstreams=[]), "upstreams", "non-empty list"),
    (lambda r: r.update(upstreams=[{**UPSTREAM, "weight": 1}]), "upstreams[0].weight", "unknown field"),
    (lambda r: r.update(upstreams=[{**UPSTREAM, "block_budget": 0}]), "upstreams[0].block_budget",
     "must be at least 1, got 0"),
    (lambda r: r.update(upstreams=[{**UPSTREAM, "block_budget": 2000}]), "upstreams[0].block_budget",
     "above the replica's 1999 usable blocks"),
    (lambda r: r.update(upstreams=[{k: v for k, v in UPSTREAM.items() if k != "url"}]), "upstreams[0].url",
     "missing"),
])
def test_damaged_fields_are_named(edit, field, words, tmp_path):
    with pytest.raises(InputError) as info:
        parse_recommendation(damaged(edit), path="recommendation.json")
    assert info.value.field == field
    assert words in str(info.value)
    assert len(str(info.value)) < 200


def test_per_upstream_budgets_read_back_and_a_file_without_them_has_none():
    assert read_recommendation(GOOD, path="r.json").upstreams == ()
    with_them = damaged(lambda r: r.update(upstreams=[UPSTREAM]))
    rec = read_recommendation(with_them, path="r.json")
    assert [u.to_dict() for u in rec.upstreams] == [UPSTREAM]
    assert rec.to_dict()["upstreams"] == [UPSTREAM]


def test_the_real_file_reads_back_unchanged():
    assert parse_recommendation(copy.deepcopy(GOOD), path="r.json").to_dict() == GOOD


def test_what_recommend_writes_reads_back_exactly(tmp_path):
    result = CliRunner().invoke(cli, ["recommend", str(DATA.parent.parent / "sample_logs"), "--model",
                                      "llama-3.1-8b", "--gpu", "H100-80GB", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    written = json.loads((tmp_path / "recommendation.json").read_text())
    rec = load_recommendation(tmp_path / "recommendation.json")
    assert rec.to_dict() == written
    assert rec.to_json() == (tmp_path / "recommendation.json").read_text()


def test_file_level_damage(tmp_path):
    path = tmp_path / "recommendation.json"
    path.write_text(json.dumps(GOOD, indent=2)[:3000])
    with pytest.raises(InputError, match=r"recommendation.json:\d+: invalid JSON"):
        load_recommendation(path)
    path.write_text(json.dumps(GOOD)[:-1] + ', "model": "other"}')
    with pytest.raises(InputError, match="duplicate key 'model'"):
        load_recommendation(path)


def run_check(rec_path, tmp_path):
    gateway = tmp_path / "gateway.yaml"
    gateway.write_text(json.dumps(GATEWAY))
    return CliRunner().invoke(cli, ["check", str(rec_path), "--model", "llama-3.1-8b", "--deployed", str(gateway)])


@pytest.mark.parametrize("edit, line", [
    (lambda r: r.pop("settings"), "settings: missing: not a recommendation.json? (`kvtune recommend --out DIR` writes one)"),
    (lambda r: r["routes"][0]["max_new_tokens"].update(value="many"),
     "routes[0].max_new_tokens.value: expected an integer, got 'many'"),
    (lambda r: r["routes"][0]["prompt_tokens"].update(max="7"),
     "routes[0].prompt_tokens.max: expected an integer, got '7'"),
    (lambda r: r.update(routes=[]), "routes: expected a non-empty list, got []"),
])
def test_check_names_the_damaged_field(edit, line, tmp_path):
    path = tmp_path / "recommendation.json"
    path.write_text(json.dumps(damaged(edit), indent=2))
    result = run_check(path, tmp_path)
    assert result.exit_code == 2, result.output
    assert result.stderr == f"Error: {path}: {line}\n"


def test_check_reports_a_truncated_recommendation_as_json(tmp_path):
    path = tmp_path / "recommendation.json"
    path.write_text(json.dumps(GOOD, indent=2)[:3000])
    result = run_check(path, tmp_path)
    assert result.exit_code == 2
    assert result.stderr.startswith(f"Error: {path}:") and "invalid JSON" in result.stderr


def test_bench_expect_refuses_a_share_that_is_not_a_number(tmp_path):
    from kvtune.cli.bench import _parse_expect

    path = tmp_path / "recommendation.json"
    path.write_text(json.dumps(damaged(lambda r: r["routes"][0].update(truncation_share="0.1"))))
    with pytest.raises(InputError) as info:
        _parse_expect(str(path))
    assert str(info.value) == (f"{path}: --expect: routes[0].truncation_share: expected a number, got '0.1'")


def leaf_paths(value, path=()):
    """Every key and list item of the file, as (path as written in errors, keys to reach it)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield path + (key,)
            yield from leaf_paths(item, path + (key,))
    elif isinstance(value, list):
        for i, item in enumerate(value[:2]):
            yield from leaf_paths(item, path + (i,))


def spelled(keys) -> str:
    out = ""
    for k in keys:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else k)
    return out


def reach(data, keys):
    for k in keys:
        data = data[k]
    return data


@pytest.mark.parametrize("keys", list(leaf_paths(GOOD)), ids=spelled)
def test_every_field_removed_or_mistyped_is_named_or_harmless(keys):
    """Removing any member is an error naming it (or, for an optional member, reads back as
    what its absence means); giving it a value of the wrong kind is always an error naming it
    or a member inside it."""
    removed = copy.deepcopy(GOOD)
    del reach(removed, keys[:-1])[keys[-1]]
    try:
        parse_recommendation(removed, path="r.json")
    except InputError as exc:
        assert exc.field == spelled(keys), str(exc)
    original = reach(GOOD, keys)
    wrong = [] if not isinstance(original, list) else {"a": 1}
    mistyped = copy.deepcopy(GOOD)
    reach(mistyped, keys[:-1])[keys[-1]] = wrong
    with pytest.raises(InputError) as info:
        parse_recommendation(mistyped, path="r.json")
    assert str(info.value.field).startswith(spelled(keys)), str(info.value)
