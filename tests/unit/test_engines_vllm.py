"""vLLM's facts as kvtune states them (reference/vllm-facts.md §1, §4, §6)."""

from __future__ import annotations

import pytest

from kvtune.engines import vllm
from kvtune.engines.vllm import default_batch_limits, default_block_size
from kvtune.hardware import GPUS, GiB


@pytest.mark.parametrize(
    ("gpu", "expected"),
    [
        ("H100-80GB", (8192, 1024)),  # 79.65 GiB ≥ 70, not an A100
        ("H200", (8192, 1024)),  # 140.4 GiB: ≥ 70 but < 160
        ("B200", (16384, 1024)),  # 179.1 GiB ≥ 160
        ("A100-80GB", (2048, 256)),  # ≥ 70 GiB but an A100: vLLM keeps the small default
        ("L4", (2048, 256)),
    ],
)
def test_vllm_serve_batch_defaults_by_gpu(gpu, expected):
    g = GPUS[gpu]
    assert default_batch_limits(g.memory_bytes, g.name) == expected


def test_batch_defaults_without_a_name_use_memory_alone():
    assert default_batch_limits(80 * GiB, None) == (8192, 1024)
    assert default_batch_limits(69 * GiB, None) == (2048, 256)


@pytest.mark.parametrize(("device", "block_size"), [("GPU", 16), (None, 16), ("CPU", 128), ("cpu", 128)])
def test_block_size_by_device(device, block_size):
    assert default_block_size(device) == block_size


def test_the_startup_lines_of_every_release_match():
    line = "CPU KV cache size: 4,096 tokens, Maximum concurrency for 512 tokens per request: 8.00x"
    size, concurrency = vllm.KV_CACHE_SIZE_LINE.search(line), vllm.MAX_CONCURRENCY_LINE.search(line)
    assert (size["device"], size["tokens"], concurrency["len"], concurrency["x"]) == ("CPU", "4,096", "512", "8.00")
    assert vllm.NUM_BLOCKS_LINE.search("# GPU blocks: 865, # CPU blocks: 327")["blocks"] == "865"
    assert vllm.BLOCKS_OVERRIDE_LINE.search(
        "Overriding num_gpu_blocks=1000 with num_gpu_blocks_override=32")["new"] == "32"

