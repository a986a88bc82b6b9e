"""The public Python API: the docs' script writes the bytes `kvtune recommend --out` writes,
every exported name resolves and is documented, and bad options are errors naming the field."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvtune
from kvtune.errors import KvtuneError

ROOT = Path(__file__).resolve().parents[2]


def docs_api_script() -> str:
    """The script in the docs' Python API page (it lived in the README's section of that name)."""
    text = (ROOT / "docs" / "reference" / "api.md").read_text(encoding="utf-8")
    found = re.search(r"^# Python API$.*?^```python\n(.*?)^```$", text, re.S | re.M)
    assert found, "docs/reference/api.md has no Python API section with a ```python block"
    return found.group(1)


def test_the_docs_api_script_writes_the_bytes_the_cli_writes(tmp_path):
    (tmp_path / "sample_logs").symlink_to(ROOT / "sample_logs")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    api = subprocess.run([sys.executable, "-c", docs_api_script()], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert api.returncode == 0, api.stderr
    cli = subprocess.run([sys.executable, "-m", "kvtune", "recommend", "sample_logs/", "--model", "llama-3.1-8b",
                          "--gpu", "H100-80GB", "--out", "cli/"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    def files(folder: Path) -> dict[str, bytes]:  # with nginx.conf's Lua modules under lua/
        return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}

    by_api, by_cli = files(tmp_path / "deploy"), files(tmp_path / "cli")
    assert sorted(by_api) == sorted(by_cli) and len(by_api) >= 5
    for name in by_cli:
        assert by_api[name] == by_cli[name], name


def test_every_exported_name_resolves_and_is_documented():
    assert "recommend" in dir(kvtune)
    for name in kvtune.__all__:
        value = getattr(kvtune, name)
        if name != "__version__":
            assert value.__doc__ and value.__doc__.strip(), name
    for name in ("profile_logs", "load_profile", "plan", "recommend", "render", "check", "load_recommendation"):
        assert ">>>" in getattr(kvtune, name).__doc__, f"{name} has no example"
    with pytest.raises(AttributeError):
        kvtune.no_such_name  # noqa: B018 - the attribute access is the test


@pytest.mark.parametrize(("changes", "field", "message"), [
    ({"safety_fraction": 1.5}, "safety_fraction", "between 0 and 1"),
    ({"safety_fraction": 0.0}, "safety_fraction", "between 0 and 1"),
    ({"max_truncation": -0.1}, "max_truncation", "between 0 and 1"),
    ({"vllm_version": "latest"}, "vllm_version", "version"),
    ({"route_by": ""}, "route_by", "route"),
])
def test_bad_recommend_options_name_the_field(changes, field, message):
    profile = kvtune.profile_logs([ROOT / "sample_logs"])
    plan = kvtune.plan(kvtune.Deployment("llama-3.1-8b", gpu="H100-80GB"))
    with pytest.raises(KvtuneError) as caught:
        kvtune.recommend(profile, plan, kvtune.Policy(**changes))
    assert caught.value.field == field and message in str(caught.value)


def test_profile_logs_takes_the_on_error_words(tmp_path):
    path = tmp_path / "logs.jsonl"
    path.write_text('{"route": "/a", "output_tokens": 5}\n{oops\n')
    assert kvtune.profile_logs([path], kvtune.LogReading(on_error="skip")).skipped == {"malformed JSON": 1}
    with pytest.raises(KvtuneError, match=r":2: malformed JSON"):
        kvtune.profile_logs([path], kvtune.LogReading(on_error="fail"))
    with pytest.raises(KvtuneError) as caught:
        kvtune.profile_logs([path], kvtune.LogReading(on_error="stop"))
    assert caught.value.field == "on_error" and "use skip or fail" in str(caught.value)


def test_recommend_follows_the_release_the_plan_assumed():
    profile = kvtune.profile_logs([str(Path(__file__).parents[1] / "data" / "logs" / "kvtune.jsonl")])
    rec = kvtune.recommend(profile, kvtune.plan(kvtune.Deployment("llama-3.1-8b", gpu="H100-80GB", engine_version="0.6.3")))
    assert (rec.engine.version, rec.engine.v1) == ("0.6.3", False)
