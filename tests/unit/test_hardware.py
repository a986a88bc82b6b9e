"""GPU catalog lookups, memory-size parsing and vLLM's batch defaults by GPU size."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtune.errors import KvtuneError, UnknownNameError
from kvtune.hardware import GPUS, GiB, MiB, find_gpu, parse_memory_size

REQUIRED = ["A10G", "L4", "L40S", "A100-40GB", "A100-80GB", "H100-80GB", "H200", "B200", "MI300X",
            "RTX-3090", "RTX-4090"]


def test_catalog_has_every_required_gpu_with_memory_and_bandwidth():
    for name in REQUIRED:
        gpu = GPUS[name]
        assert gpu.memory_bytes > 16 * GiB
        assert gpu.hbm_bandwidth_bytes_per_s >= 300 * 10**9


def test_memory_is_the_reported_total_not_the_marketing_figure():
    # nvidia-smi reports 81,559 MiB on an H100 80GB: 81,559 × 1,048,576 = 85,520,809,984 B ≈ 79.65 GiB
    assert GPUS["H100-80GB"].memory_bytes == 85_520_809_984
    assert round(GPUS["H100-80GB"].memory_gib, 2) == 79.65
    assert GPUS["H100-80GB"].hbm_bandwidth_bytes_per_s == 3_350_000_000_000


@pytest.mark.parametrize(
    ("given_name", "expected"),
    [("h100", "H100-80GB"), ("H100_80GB", "H100-80GB"), ("a100", "A100-80GB"), ("A100-40gb", "A100-40GB"),
     ("rtx 4090", "RTX-4090"), ("4090", "RTX-4090"), ("mi300x", "MI300X"), ("  l40s ", "L40S")],
)
def test_find_gpu_ignores_case_spacing_and_knows_aliases(given_name, expected):
    assert find_gpu(given_name).name == expected


def test_unknown_gpu_names_close_matches_and_the_option():
    with pytest.raises(UnknownNameError) as info:
        find_gpu("H1000")
    text = str(info.value)
    assert text.startswith("gpu: unknown GPU 'H1000'; did you mean H100-80GB?")
    assert "MI300X" in text  # the known list follows


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("79.2GiB", int(79.2 * 1024**3)),  # 85,040,352,870.4 → 85,040,352,870
        ("80GB", 80_000_000_000),
        ("80 gb", 80_000_000_000),
        ("24576MiB", 24_576 * MiB),  # 25,769,803,776
        ("1TiB", 1024**4),
        ("512B", 512),
    ],
)
def test_parse_memory_size(text, expected):
    assert parse_memory_size(text) == expected


@pytest.mark.parametrize("text", ["80", "GiB", "-5GiB", "80GiBs", "0GiB", "1e3GB", "eighty GB", ""])
def test_bad_memory_sizes_name_the_option(text):
    with pytest.raises(KvtuneError) as info:
        parse_memory_size(text)
    assert str(info.value).startswith("gpu_memory: ")


@given(st.integers(min_value=1, max_value=10**7))
def test_mib_and_mb_are_exact(n):
    assert parse_memory_size(f"{n}MiB") == n * 2**20
    assert parse_memory_size(f"{n}MB") == n * 10**6


@given(st.from_regex(r"\s*(\d{1,500}(\.\d{0,30})?|\.\d{1,30})\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB|gb|x)?\s*", fullmatch=True)
       | st.text(max_size=50))
def test_any_memory_text_is_a_size_or_one_error_line(text):
    """The class behind `--gpu-memory 1e400GB`: any text is a size of at most 1 PiB or a
    KvtuneError naming the parameter in one short line (the CLI names the flag), never an OverflowError."""
    try:
        size = parse_memory_size(text)
    except KvtuneError as exc:
        message = str(exc)
        assert message.startswith("gpu_memory: ") and "\n" not in message and len(message) < 300
    else:
        assert 0 < size <= 1024**5


@pytest.mark.parametrize("text", ["9" * 400 + "GB", "1025TiB", "2000000TB", "1" + "0" * 309 + "B"])
def test_absurd_memory_sizes_are_errors(text):
    with pytest.raises(KvtuneError, match="beyond any device"):
        parse_memory_size(text)
