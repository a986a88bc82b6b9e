"""bench's renamed options against the fake vLLM on loopback: --request-model (old --model) and
--save FILE (old --out) send and write the same under both spellings; the old one warns once."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from fake_vllm import TEMPLATED, FakeVllm

from kvtune.cli import cli
from kvtune.profile.build import save_profile
from kvtune.profile.histogram import Histogram, JointHistogram, joint_bin
from kvtune.profile.routes import CensoredHistogram, Profile, RouteProfile


@pytest.fixture
def profile_path(tmp_path) -> str:
    prompts, outputs = np.array([20, 40] * 5), np.array([5, 10] * 5)
    route = RouteProfile(route="/v1/chat/completions", output=CensoredHistogram.of(outputs, np.zeros(10, bool)),
                         total=CensoredHistogram.empty(), prompt=Histogram.of(prompts), max_tokens=Histogram.empty(),
                         joint=JointHistogram(joint_bin(prompts), joint_bin(outputs), np.ones(10, np.int64)),
                         finish_reasons={}, models={})
    path = tmp_path / "profile.json"
    save_profile(Profile(routes=(route,)), path)
    return str(path)


def _bench(tmp_path, profile_path: str, model_flag: str, save_flag: str, name: str):
    """One run of 6 requests: what the server was sent, what bench printed and saved."""
    saved = tmp_path / f"{name}.json"
    with FakeVllm(tokens=TEMPLATED) as server:
        result = CliRunner().invoke(cli, ["bench", server.url, "--profile", profile_path, "--requests", "6",
                                          "--concurrency", "2", "--seed", "3", model_flag, "served-name",
                                          save_flag, str(saved)], catch_exceptions=False)
        sent = sorted({call.parsed["model"] for call in server.engine_calls if isinstance(call.parsed, dict)})
    return result, sent, json.loads(saved.read_text())


def test_request_model_and_save_under_both_spellings(tmp_path, profile_path):
    new, sent_new, saved_new = _bench(tmp_path, profile_path, "--request-model", "--save", "new")
    old, sent_old, saved_old = _bench(tmp_path, profile_path, "--model", "--out", "old")
    assert new.exit_code == old.exit_code == 0, old.output
    assert sent_new == sent_old == ["served-name"]  # the request's model field, as before
    assert new.stderr == ""
    assert old.stderr == ("Warning: --model is deprecated; use --request-model (removed in the next release)\n"
                          "Warning: --out is deprecated; use --save (removed in the next release)\n")
    assert saved_new.keys() == saved_old.keys()
    assert saved_new["requests"] == saved_old["requests"]
