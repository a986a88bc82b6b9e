"""Shared test fixtures: where the real configs and traces live, and an isolated environment."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# ../shared beside the checkout (CI clones main with a copy of shared/ next to it).
SHARED = REPO.parent / "shared"
CONFIGS = SHARED / "configs"
TRACES = SHARED / "traces"


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch, tmp_path):
    """No test reaches a model hub or reads the developer's own HF cache."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
