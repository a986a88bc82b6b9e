"""GPU catalog and memory-size parsing: the hardware side of the capacity arithmetic.

Memory is the total a device reports (nvidia-smi / rocm-smi "total", i.e. what
`torch.cuda.mem_get_info` calls total and what vLLM multiplies by gpu_memory_utilization),
not the marketing figure: an "80 GB" H100 reports 81,559 MiB. Bandwidth is the vendor's
peak HBM/GDDR figure for the SXM/OAM part where one exists (decimal GB/s). Peak FLOPs are the
vendor's dense tensor figures per dtype (datasheets quote "with sparsity", twice that; the table
below says where each comes from); None where the GPU has no such tensor path or no figure was
found. A GPU outside the catalog is described by a --gpu-spec file (kvtune.gpu_spec).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from kvtune.errors import OptionError, UnknownNameError

MiB = 1024**2
GiB = 1024**3
GB = 1000**3


#: The dtypes a GPU's peak matmul rate is given for (Gpu.peak_dense_flops).
MATMUL_DTYPES = ("bf16", "fp8", "int8", "int4", "fp4")


@dataclass(frozen=True, slots=True)
class Gpu:
    """One accelerator model: how much memory vLLM can see, how fast it streams, and how fast its
    tensor cores multiply in each dtype (peak dense, no sparsity; None: not supported or no figure)."""

    name: str
    memory_bytes: int
    hbm_bandwidth_bytes_per_s: int
    vendor: str
    aliases: tuple[str, ...] = ()
    bf16_dense_flops: float | None = None  # peak dense BF16 tensor FLOP/s, for the roofline step time
    fp8_dense_flops: float | None = None
    int8_dense_ops: float | None = None
    int4_dense_ops: float | None = None
    fp4_dense_flops: float | None = None  # NVFP4/MXFP4 tensor cores (Blackwell)
    #: aiconfigurator-core's system name where it ships measured kernel timings for this GPU
    #: (its systems/data/<name>/ holds gemm/attention/… tables); None: it has none
    silicon_system: str | None = None
    #: where the figures come from: "catalog", or the --gpu-spec file that described it
    origin: str = "catalog"

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GiB

    def peak_dense_flops(self, dtype: str) -> float | None:
        """Peak dense tensor FLOP/s (OP/s for integers) in `dtype` (one of MATMUL_DTYPES)."""
        return {"bf16": self.bf16_dense_flops, "fp8": self.fp8_dense_flops, "int8": self.int8_dense_ops,
                "int4": self.int4_dense_ops, "fp4": self.fp4_dense_flops}[dtype]


def _gpu(name: str, memory_mib: int, bandwidth_gb_s: int, vendor: str, *aliases: str,
         bf16: float | None = None, fp8: float | None = None, int8: float | None = None,
         int4: float | None = None, fp4: float | None = None, silicon: str | None = None) -> Gpu:
    """A catalog entry from the datasheet's units: MiB reported, GB/s, dense TFLOPS/TOPS."""
    def tera(x: float | None) -> float | None:
        return None if x is None else x * 1e12

    return Gpu(name, memory_mib * MiB, bandwidth_gb_s * GB, vendor, aliases, tera(bf16), tera(fp8), tera(int8),
               tera(int4), tera(fp4), silicon)


# Peak dense tensor TFLOPS (TOPS for int), half the "with sparsity" (*) figure where a datasheet
# gives only that. Datasheet per GPU (vendor's unless marked); "aic" = aiconfigurator-core 0.12.0
# systems/<name>.yaml, whose comments cite the vendor figure, used where no datasheet was at hand:
#   A10G        none: AWS publishes no tensor figure for this variant of the A10
#   L4          NVIDIA L4 datasheet: BF16 242*, FP8 485*, INT8 485* -> 121 / 242.5 / 242.5
#   L40S        NVIDIA L40S datasheet: BF16 362.05 | 733*, FP8 733 | 1,466*, INT8 733 | 1,466*
#   L20         NVIDIA L20 product brief: 48 GB GDDR6 864 GB/s, BF16 119.5 | 239*, FP8 239 | 478*,
#               INT8 239 | 478* (nvidia-smi total 46,068 MiB, as the L40S)
#   A100        NVIDIA A100 datasheet: BF16 312 | 624*, INT8 624 | 1,248*, INT4 1,248 | 2,496*;
#               no FP8 (Ampere). A800: the A100 80GB's compute and HBM2e, NVLink 400 GB/s
#   H100 SXM    NVIDIA H100 datasheet: BF16 1,979*, FP8 3,958*, INT8 3,958* -> 989 / 1,979 / 1,979;
#               H800 SXM: the same compute and HBM3 (NVLink 400 GB/s)
#   H100 PCIe   NVIDIA H100 datasheet (PCIe column): 2.0 TB/s, BF16 1,513*, FP8 3,026*, INT8 3,026*
#   H200        NVIDIA H200 datasheet: 4.8 TB/s, BF16 1,979*, FP8 3,958*, INT8 3,958* (GH100 compute)
#   H20         NVIDIA H20 (China) spec: 96 GB HBM3 4.0 TB/s, BF16 148, FP8 296, INT8 296 (dense);
#               nvidia-smi 97,871 MiB
#   GH200       NVIDIA GH200 Grace Hopper datasheet (96 GB HBM3 part): 4 TB/s, BF16 990 | 1,979*,
#               FP8 1,979 | 3,958*; nvidia-smi 97,871 MiB
#   B200        NVIDIA HGX B200 (1,000 W): BF16 2.25 PFLOPS, FP8/INT8 4.5, FP4 9 dense
#   B300        aic b300_sxm: 7.75 TB/s, BF16 2,250, FP8 4,500, INT8 153.5, FP4 14,000 (nvidia-smi 275,040 MiB)
#   GB200       NVIDIA GB200 NVL72 datasheet per GPU (aic gb200): 8 TB/s, BF16 2,500, FP8/INT8 5,000,
#               FP4 10,000 dense (nvidia-smi 189,471 MiB)
#   GB300       aic gb300: 8 TB/s, BF16 2,500, FP8 5,000, INT8 165, FP4 15,000 (nvidia-smi 284,208 MiB)
#   RTX PRO 6000  Blackwell Server Edition, aic rtx_pro_6000_server: 1.792 TB/s GDDR7, BF16 467.8,
#               FP8/INT8 935.6, FP4 1,871.2 dense at 2,430 MHz (nvidia-smi 97,887 MiB)
#   Arc Pro B60 Intel Arc Pro B60 spec (aic b60): 24 GB GDDR6 456 GB/s, INT8 197 TOPS, BF16 98.3; no FP8
#   MI300X      AMD Instinct MI300X datasheet: BF16 1,307.4, FP8 2,614.9, INT8 2,614.9 dense
#   MI325X      AMD Instinct MI325X datasheet: 256 GB HBM3E 6 TB/s, BF16 1,307.4, FP8 2,614.9,
#               INT8 2,614.9 dense (rocm-smi total not found: 256 GiB taken)
#   RTX 3090    NVIDIA Ampere GA102 whitepaper: BF16 (FP32 accumulate) 71 | 142*, INT8 284 | 568*,
#               INT4 568 | 1,136*
#   RTX 4090    NVIDIA Ada Lovelace whitepaper: BF16 and FP8 (FP32 accumulate) 165.2 | 330.4* and
#               330.3 | 660.6*, INT8 660.6 | 1,321.2*
# Memory is the reported total in MiB (nvidia-smi `memory.total`; MI300X from rocm-smi's
# 205,822,885,888 B). silicon: the aiconfigurator-core 0.12.0 system with measured data
# (systems/data/<name>/ non-empty: a100_sxm, b200_sxm, b300_sxm, b60, gb200, gb300, h100_sxm,
# h200_sxm, l40s, rtx_pro_6000_server; a100_pcie, a30, h100_pcie and l4 have a system file only).
GPUS: dict[str, Gpu] = {
    g.name: g
    for g in (
        _gpu("A10G", 23_028, 600, "NVIDIA", "a10g", "a10"),
        _gpu("L4", 23_034, 300, "NVIDIA", "l4", bf16=121, fp8=242.5, int8=242.5),
        _gpu("L40S", 46_068, 864, "NVIDIA", "l40s", bf16=362.05, fp8=733, int8=733, silicon="l40s"),
        _gpu("L20", 46_068, 864, "NVIDIA", "l20", bf16=119.5, fp8=239, int8=239),
        _gpu("A100-40GB", 40_960, 1_555, "NVIDIA", "a100-40", "a100-40g", "a100_40gb", bf16=312, int8=624,
             int4=1248),
        _gpu("A100-80GB", 81_920, 2_039, "NVIDIA", "a100", "a100-80", "a100-80g", "a100_80gb", "a100-sxm",
             bf16=312, int8=624, int4=1248, silicon="a100_sxm"),
        _gpu("A800-80GB", 81_920, 2_039, "NVIDIA", "a800", "a800-80", "a800-sxm", bf16=312, int8=624, int4=1248),
        _gpu("H100-80GB", 81_559, 3_350, "NVIDIA", "h100", "h100-sxm", "h100-80", "h100_80gb", bf16=989, fp8=1979,
             int8=1979, silicon="h100_sxm"),
        _gpu("H100-PCIe", 81_559, 2_000, "NVIDIA", "h100-pcie-80gb", "h100pcie", bf16=756.5, fp8=1513, int8=1513),
        _gpu("H800", 81_559, 3_350, "NVIDIA", "h800-80gb", "h800-sxm", bf16=989, fp8=1979, int8=1979),
        _gpu("H200", 143_771, 4_800, "NVIDIA", "h200-141gb", "h200-sxm", bf16=989, fp8=1979, int8=1979,
             silicon="h200_sxm"),
        _gpu("H20", 97_871, 4_000, "NVIDIA", "h20-96gb", bf16=148, fp8=296, int8=296),
        _gpu("GH200", 97_871, 4_000, "NVIDIA", "gh200-96gb", "gh200-480gb", bf16=989, fp8=1979, int8=1979),
        _gpu("B200", 183_359, 8_000, "NVIDIA", "b200-180gb", "b200-sxm", bf16=2250, fp8=4500, int8=4500, fp4=9000,
             silicon="b200_sxm"),
        _gpu("B300", 275_040, 7_750, "NVIDIA", "b300-sxm", "b300-288gb", bf16=2250, fp8=4500, int8=153.5,
             fp4=14000, silicon="b300_sxm"),
        _gpu("GB200", 189_471, 8_000, "NVIDIA", "gb200-nvl72", bf16=2500, fp8=5000, int8=5000, fp4=10000,
             silicon="gb200"),
        _gpu("GB300", 284_208, 8_000, "NVIDIA", "gb300-nvl72", bf16=2500, fp8=5000, int8=165, fp4=15000,
             silicon="gb300"),
        _gpu("RTX-PRO-6000", 97_887, 1_792, "NVIDIA", "rtx pro 6000", "rtx-pro-6000-server", "rtx_pro_6000_server",
             "rtx pro 6000 blackwell server edition", bf16=467.8, fp8=935.6, int8=935.6, fp4=1871.2,
             silicon="rtx_pro_6000_server"),
        _gpu("Arc-Pro-B60", 24_576, 456, "Intel", "b60", "arc pro b60", bf16=98.3, int8=197, silicon="b60"),
        _gpu("MI300X", 196_288, 5_300, "AMD", "mi300", "mi300x-192gb", bf16=1307.4, fp8=2614.9, int8=2614.9),
        _gpu("MI325X", 262_144, 6_000, "AMD", "mi325", "mi325x-256gb", bf16=1307.4, fp8=2614.9, int8=2614.9),
        _gpu("RTX-3090", 24_576, 936, "NVIDIA", "3090", "rtx3090", "rtx 3090", "geforce rtx 3090", bf16=71, int8=284,
             int4=568),
        _gpu("RTX-4090", 24_564, 1_008, "NVIDIA", "4090", "rtx4090", "rtx 4090", "geforce rtx 4090", bf16=165.2,
             fp8=330.3, int8=660.6),
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


__all__ = ["Gpu", "GPUS", "MATMUL_DTYPES", "GiB", "MiB", "GB", "find_gpu", "parse_memory_size"]
