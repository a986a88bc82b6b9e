"""GPU catalog and memory-size parsing: the hardware side of the capacity arithmetic.

Memory is the total a device reports (nvidia-smi / rocm-smi "total", i.e. what
`torch.cuda.mem_get_info` calls total and what vLLM multiplies by gpu_memory_utilization),
not the marketing figure: an "80 GB" H100 reports 81,559 MiB. Bandwidth is the vendor's
peak HBM/GDDR figure for the SXM/OAM part where one exists (decimal GB/s). Peak FLOPs are the
vendor's dense BF16 tensor figure (datasheets quote "with sparsity", twice that; the table below
says where each comes from); None where no vendor figure was found.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from kvtune.errors import OptionError, UnknownNameError

MiB = 1024**2
GiB = 1024**3
GB = 1000**3


@dataclass(frozen=True, slots=True)
class Gpu:
    """One accelerator model: how much memory vLLM can see and how fast it streams."""

    name: str
    memory_bytes: int
    hbm_bandwidth_bytes_per_s: int
    vendor: str
    aliases: tuple[str, ...] = ()
    bf16_dense_flops: float | None = None  # peak dense BF16 tensor FLOP/s, for the roofline step time

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GiB


def _gpu(name: str, memory_mib: int, bandwidth_gb_s: int, vendor: str, *aliases: str,
         bf16_tflops: float | None = None) -> Gpu:
    return Gpu(name, memory_mib * MiB, bandwidth_gb_s * GB, vendor, aliases,
               None if bf16_tflops is None else bf16_tflops * 1e12)


# Dense BF16 tensor TFLOPS, half the "with sparsity" figure where a datasheet gives only that:
#   L4          NVIDIA L4 datasheet: BF16 242* (*with sparsity) -> 121
#   L40S        NVIDIA L40S datasheet: BF16 362.05 | 733*
#   A100        NVIDIA A100 datasheet: BF16 312 | 624* (40 GB and 80 GB alike)
#   H100 SXM    NVIDIA H100 datasheet: BF16 1,979* -> 989 (989.4 in the Hopper whitepaper)
#   H200        NVIDIA H200 datasheet: BF16 1,979* -> 989 (the same GH100 compute)
#   B200        NVIDIA HGX B200 (1,000 W): BF16 2.25 PFLOPS dense, 4.5 with sparsity
#   MI300X      AMD Instinct MI300X datasheet: BF16 1,307.4 dense, 2,614.9 with sparsity
#   RTX 3090    NVIDIA Ampere GA102 whitepaper: BF16 tensor, FP32 accumulate, 71 | 142*
#   RTX 4090    NVIDIA Ada Lovelace whitepaper: BF16 tensor, FP32 accumulate, 165.2 | 330.4*
#   A10G        none: AWS publishes no tensor figure for this variant of the A10


# Reported totals in MiB (nvidia-smi `memory.total`; MI300X from rocm-smi's 205,822,885,888 B).
GPUS: dict[str, Gpu] = {
    g.name: g
    for g in (
        _gpu("A10G", 23_028, 600, "NVIDIA", "a10g", "a10"),
        _gpu("L4", 23_034, 300, "NVIDIA", "l4", bf16_tflops=121),
        _gpu("L40S", 46_068, 864, "NVIDIA", "l40s", bf16_tflops=362.05),
        _gpu("A100-40GB", 40_960, 1_555, "NVIDIA", "a100-40", "a100-40g", "a100_40gb", bf16_tflops=312),
        _gpu("A100-80GB", 81_920, 2_039, "NVIDIA", "a100", "a100-80", "a100-80g", "a100_80gb", bf16_tflops=312),
        _gpu("H100-80GB", 81_559, 3_350, "NVIDIA", "h100", "h100-sxm", "h100-80", "h100_80gb", bf16_tflops=989),
        _gpu("H200", 143_771, 4_800, "NVIDIA", "h200-141gb", "h200-sxm", bf16_tflops=989),
        _gpu("B200", 183_359, 8_000, "NVIDIA", "b200-180gb", bf16_tflops=2250),
        _gpu("MI300X", 196_288, 5_300, "AMD", "mi300", "mi300x-192gb", bf16_tflops=1307.4),
        _gpu("RTX-3090", 24_576, 936, "NVIDIA", "3090", "rtx3090", "rtx 3090", "geforce rtx 3090", bf16_tflops=71),
        _gpu("RTX-4090", 24_564, 1_008, "NVIDIA", "4090", "rtx4090", "rtx 4090", "geforce rtx 4090", bf16_tflops=165.2),
    )
}


def _key(name: str) -> str:
    """Case, spaces, dashes and underscores do not distinguish GPU names."""
    return re.sub(r"[\s_\-]+", "", name.strip().lower())


_LOOKUP: dict[str, Gpu] = {}
for _g in GPUS.values():
    for _n in (_g.name, *_g.aliases):
        _LOOKUP[_key(_n)] = _g


def find_gpu(name: str, *, field: str = "gpu") -> Gpu:
    """The catalog entry for `name` (any case, aliases like `h100`), or an error naming close ones."""
    gpu = _LOOKUP.get(_key(name))
    if gpu is not None:
        return gpu
    close = difflib.get_close_matches(_key(name), list(_LOOKUP), n=3, cutoff=0.5)
    names = sorted({_LOOKUP[c].name for c in close})
    hint = f"did you mean {', '.join(names)}? " if names else ""
    raise UnknownNameError(
        f"unknown GPU {_short(name)}; {hint}known: {', '.join(GPUS)} "
        "(or give the memory size, `gpu_memory`, e.g. 79.2GiB)",
        field=field,
    )


_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}  # fmt: skip
_SIZE = re.compile(r"(?P<num>\d+(?:\.\d+)?|\.\d+)\s*(?P<unit>[a-zA-Z]+)")
#: No accelerator has a PiB of memory: a larger size is a typo (an extra unit prefix, digits).
MAX_MEMORY_BYTES = 1024**5


def parse_memory_size(text: str, *, field: str = "gpu_memory") -> int:
    """Bytes in `text` such as `79.2GiB`, `80GB`, `24576MiB`; a unit is required (GiB ≠ GB)."""
    match = _SIZE.fullmatch(text.strip())
    unit = match.group("unit").lower() if match else None
    if match is None or unit not in _UNITS:
        raise OptionError(
            f"cannot read memory size {_short(text)}; write a number and a unit, "
            "e.g. 79.2GiB, 80GB, 24576MiB (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)",
            field=field,
        )
    size = float(match.group("num")) * _UNITS[unit]  # inf for hundreds of digits
    if not size <= MAX_MEMORY_BYTES:
        raise OptionError(f"memory size {_short(text)} is beyond any device (more than 1 PiB)", field=field)
    size_bytes = int(size)
    if size_bytes <= 0:
        raise OptionError(f"memory size must be positive, got {_short(text)}", field=field)
    return size_bytes


def _short(text: str) -> str:
    """The user's text for an error line, quoted and cut to a readable length."""
    shown = repr(text)
    return shown if len(shown) <= 44 else shown[:40] + "...'"


__all__ = ["Gpu", "GPUS", "GiB", "MiB", "GB", "find_gpu", "parse_memory_size"]
