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


# --- a real vLLM on CPU (tests/vllm_server.py documents the interface) -------------------------


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory) -> Path:
    """The tiny Llama (2 layers × 2 kv heads × head_dim 32, bf16, one token per word) vLLM serves."""
    from vllm_server import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("vllm") / "tiny-model")


class _VllmFactory:
    """Starts vLLM servers on demand, one at a time, reusing a running one with the same kwargs."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.current: tuple[tuple, object] | None = None  # (kwargs key, VllmServer)

    def __call__(self, **start_kwargs):
        from vllm_server import start_vllm, stop_vllm

        start_kwargs.setdefault("model_dir", self.model_dir)
        key = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in start_kwargs.items()))
        if self.current is not None:
            current_key, server = self.current
            if current_key == key and server.process.poll() is None:
                return server
            self.current = None
            stop_vllm(server)
        model_dir = start_kwargs.pop("model_dir")
        server = start_vllm(model_dir, **start_kwargs)
        self.current = (key, server)
        return server

    def close(self) -> None:
        from vllm_server import stop_vllm

        if self.current is not None:
            _, server = self.current
            self.current = None
            stop_vllm(server)


@pytest.fixture(scope="session")
def vllm_factory(vllm_model_dir):
    """factory(**start_vllm kwargs) -> VllmServer; at most one vLLM alive, all stopped at session end."""
    factory = _VllmFactory(vllm_model_dir)
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture
def vllm_server(vllm_factory):
    """The default server: max_model_len 512, 2 MiB of KV = 32 blocks × 128 tokens = 4,096 tokens.

    One process serves the whole session (the factory caches it), but the fixture is per test:
    a test that asks the factory for another configuration stops it, and the next test that asks
    for `vllm_server` must get a live one back, not a stale session value.
    """
    return vllm_factory(max_model_len=512, kv_cache_memory_bytes=2 * 1024**2)
