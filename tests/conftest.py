"""Shared test fixtures: where the real configs and traces live, and an isolated environment."""

from __future__ import annotations

import json
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_server import TOKENIZERS

REPO = Path(__file__).resolve().parents[1]
# Copies of real model configs and trace excerpts; tests/data/SOURCES.md names where each came from.
DATA = Path(__file__).resolve().parent / "data"
CONFIGS = DATA / "configs"
TRACES = DATA / "traces"


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch, tmp_path):
    """No test reaches a model hub or reads the developer's own HF cache."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)


# --- a tiny tokenizer with a chat template, as the gateway counts prompts with -----------------

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    "{% if tools %}<|tools|>{{ tools | tojson }}{% endif %}"
    "{% if think %}<|think|>{% endif %}"
)


@pytest.fixture
def model_dir(tmp_path):
    """A tiny word-level tokenizer with special tokens and a BOS post-processor, as vLLM test
    models are built: tokenizer.json + tokenizer_config.json with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|system|>", "<|assistant|>", "<|end|>",
                "<|tools|>", "<|think|>"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["hello world how are you today", "the quick brown fox"],
                            trainers.WordLevelTrainer(special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}))
    return tmp_path


# --- a real vLLM on CPU (tests/support/vllm_server.py documents the interface) -------------------------


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory) -> Path:
    """The tiny Llama (2 layers × 2 kv heads × head_dim 32, bf16, one token per word) vLLM serves."""
    from vllm_server import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("vllm") / "tiny-model")


@pytest.fixture(scope="session")
def vllm_model_dir_for(tmp_path_factory, vllm_model_dir):
    """get(tokenizer) -> the tiny model directory with that tokenizer (vllm_server.TOKENIZERS),
    written on first use; "word" is vllm_model_dir itself."""
    from vllm_server import write_tiny_model

    made = {"word": vllm_model_dir}

    def get(tokenizer: str) -> Path:
        if tokenizer not in made:
            made[tokenizer] = write_tiny_model(tmp_path_factory.mktemp(f"vllm-{tokenizer}") / "tiny-model",
                                               tokenizer=tokenizer)
        return made[tokenizer]

    return get


def _vllm_group(item: pytest.Item) -> tuple[int, int]:
    """Which vLLM server a test runs on, as a sort key: (tokenizer, server). The factory keeps one
    server alive and a start costs ~45 s on 2 cores, so tests of one server run back to back: the
    default server (vllm_server, vllm_server_each_tokenizer) first, then test_gateway_live's
    engine, then servers of their own (other settings, or processes a test starts itself)."""
    callspec = getattr(item, "callspec", None)
    tokenizer = callspec.params.get("vllm_tokenizer", "word") if callspec is not None else "word"
    names = set(getattr(item, "fixturenames", ()))
    server = 0 if names & {"vllm_server", "vllm_server_each_tokenizer"} else 1 if "engine" in names else 2
    if tokenizer != "word":
        server = {0: 1, 1: 0}.get(server, server)  # the word tokenizer's last server is not this one's
    return TOKENIZERS.index(tokenizer), server


@pytest.hookimpl(trylast=True)  # after pytest's own ordering by session-scoped parameters
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The real-vLLM tests last, grouped by the server they run on (see _vllm_group); the order of
    every other test, and of the tests within one group, is kept."""
    live = [item for item in items if item.get_closest_marker("vllm") is not None]
    if not live:
        return
    others = [item for item in items if item.get_closest_marker("vllm") is None]
    items[:] = others + sorted(live, key=_vllm_group)


@pytest.fixture(scope="session", params=TOKENIZERS)
def vllm_tokenizer(request) -> str:
    """Each tokenizer of the test bed in turn: the toy one (a word is a token) and Mistral-7B's.
    Session scope makes pytest run every test of one tokenizer before the next, so the servers
    built on it start once each instead of once per test."""
    return request.param


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


@pytest.fixture
def vllm_server_each_tokenizer(vllm_factory, vllm_model_dir_for, vllm_tokenizer):
    """The default server (as vllm_server) on the model with each tokenizer in turn: the same
    KV pool (32 blocks × 128 tokens), so only what the tokenizer changes can differ."""
    return vllm_factory(model_dir=vllm_model_dir_for(vllm_tokenizer), max_model_len=512,
                        kv_cache_memory_bytes=2 * 1024**2)


# --- a real redis-server on loopback (tests/support/redis_server.py documents the interface) -----------


@pytest.fixture
def make_redis(tmp_path):
    """make(appendonly=False) -> a running RedisServer in its own directory; all stopped at teardown."""
    from redis_server import start_redis

    servers = []

    def make(*, appendonly: bool = False):
        server = start_redis(tmp_path / f"redis-{len(servers)}", appendonly=appendonly)
        servers.append(server)
        return server

    try:
        yield make
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def redis_server(make_redis):
    """A fresh redis-server for one test, without persistence."""
    return make_redis()


# --- paths that are not regular files (FIFO, device, directory, socket, link to a FIFO) --------

NON_REGULAR_KINDS = ("fifo", "dev-zero", "directory", "socket", "symlink-to-fifo")


@pytest.fixture(params=NON_REGULAR_KINDS)
def non_regular_file(request) -> Iterator[Path]:
    """A path kvtune must refuse to read, one of each kind; a short directory so the socket's path
    fits AF_UNIX's 108 bytes."""
    import shutil
    import socket
    import tempfile

    kind = request.param
    folder = Path(tempfile.mkdtemp(prefix="kvt"))
    sock = None
    try:
        if kind == "dev-zero":
            path = Path("/dev/zero")
        elif kind == "directory":
            path = folder / "dir.json"
            path.mkdir()
        elif kind == "socket":
            path = folder / "s.json"
            sock = socket.socket(socket.AF_UNIX)
            sock.bind(str(path))
        else:
            fifo = folder / "fifo.json"
            os.mkfifo(fifo)
            path = fifo
            if kind == "symlink-to-fifo":
                path = folder / "link.json"
                path.symlink_to(fifo)
        yield path
    finally:
        if sock is not None:
            sock.close()
        shutil.rmtree(folder, ignore_errors=True)


def _private_device(directory: Path) -> Path:
    node = directory / "null-device"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except (PermissionError, AttributeError):
        pytest.skip("making a device node needs root")
    return node


@pytest.fixture
def private_device():
    """make(directory) -> a character device node of our own (/dev/null's numbers) to aim writes
    at: a writer that replaced devices must never get the machine's /dev/null (an unfixed one did).
    Skips the test where making one needs root."""
    return _private_device


@pytest.fixture
def without_hanging():
    """call(fn, path): fn() within 10 s; a reader stuck opening a FIFO is released (a writer opens
    and closes it) and the test fails, instead of hanging the suite."""

    def call(fn, path: Path, timeout_s: float = 10.0):
        outcome: dict = {}

        def run():
            try:
                outcome["value"] = fn()
            except BaseException as exc:  # handed back to the test thread below
                outcome["error"] = exc

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            if stat.S_ISFIFO(os.stat(path).st_mode):
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                thread.join(timeout_s)
            pytest.fail(f"reading {path} did not finish within {timeout_s} s")
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("value")

    return call
