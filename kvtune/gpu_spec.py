"""A --gpu-spec file: any GPU the catalog (kvtune.hardware.GPUS) does not hold, described by hand.

    name: H100-NVL                # how outputs name it
    memory: 93.0GiB               # per GPU, with a unit (the device's reported total, as --gpu-memory)
    bandwidth_gb_s: 3900          # peak memory bandwidth, decimal GB/s
    dense_tflops:                 # peak dense tensor TFLOPS (TOPS for int), no sparsity
      bf16: 835                   #   bf16 is required: every roofline matmul can run in it
      fp8: 1670                   #   fp8, int8, int4, fp4: where the GPU has that tensor path
    vendor: NVIDIA                # optional

YAML or JSON (by the file's extension: .json is JSON). Read strictly: an unknown or missing
field, a number out of range or a memory size without a unit is one `InputError` naming the file
and the field; nothing is guessed.
"""

from __future__ import annotations

import os

from kvtune import userfiles
from kvtune.domain.fields import Fields
from kvtune.errors import OptionError
from kvtune.hardware import GB, MATMUL_DTYPES, Gpu, parse_memory_size
from kvtune.userfiles import brief

FIELDS = ("name", "memory", "bandwidth_gb_s", "dense_tflops", "vendor")
#: No device streams 1 PB/s or multiplies at 1 EFLOPS: a larger figure is a unit slip (GB/s given in B/s).
MAX_BANDWIDTH_GB_S = 1_000_000.0
#: Nor streams less than 1 GB/s (a smaller figure is TB/s given as GB/s, or one that rounds to 0 B/s).
MIN_BANDWIDTH_GB_S = 1.0
MAX_TFLOPS = 1_000_000.0
#: A spec file is a handful of lines.
GPU_SPEC_MAX_BYTES = 64 * 1024


def gpu_from_fields(f: Fields) -> Gpu:
    """The GPU one parsed spec object describes."""
    _known(f, FIELDS)
    name = f.string("name", nonempty=True)
    if len(name) > 80 or not name.isprintable():
        raise f.fail("name", f"expected a short printable name, got {brief(name)}")
    raw_memory = f.scalar("memory")
    if not isinstance(raw_memory, str):  # a bare number: GB or GiB? (8% apart) the unit is required
        raise f.fail("memory", f"expected a size with a unit such as 80GB or 79.2GiB, got {brief(raw_memory)}")
    try:
        memory = parse_memory_size(raw_memory, field=f.field("memory"))
    except OptionError as exc:  # re-raised with the file's name
        raise f.fail("memory", exc.message) from None
    bandwidth = f.number("bandwidth_gb_s", minimum=MIN_BANDWIDTH_GB_S, maximum=MAX_BANDWIDTH_GB_S)
    tflops = f.obj("dense_tflops")
    _known(tflops, MATMUL_DTYPES)
    peaks: dict[str, float | None] = {}
    for dtype in MATMUL_DTYPES:
        value = (tflops.number(dtype, maximum=MAX_TFLOPS) if dtype == "bf16"
                 else tflops.number(dtype, maximum=MAX_TFLOPS, optional=True))
        if value is not None and value <= 0:
            raise tflops.fail(dtype, f"must be positive, got {brief(value)} (leave it out where there is none)")
        peaks[dtype] = None if value is None else value * 1e12
    vendor = f.string("vendor", optional=True, nonempty=True) or "unknown"
    return Gpu(name=name, memory_bytes=memory, hbm_bandwidth_bytes_per_s=int(bandwidth * GB), vendor=vendor,
               bf16_dense_flops=peaks["bf16"], fp8_dense_flops=peaks["fp8"], int8_dense_ops=peaks["int8"],
               int4_dense_ops=peaks["int4"], fp4_dense_flops=peaks["fp4"], origin=f.path or "gpu-spec")


def read_gpu_spec(path: str | os.PathLike[str]) -> Gpu:
    """The GPU a --gpu-spec file describes (YAML, or JSON for a .json file)."""
    shown = os.fspath(path)
    if shown.lower().endswith(".json"):
        data = userfiles.load_json(path, max_bytes=GPU_SPEC_MAX_BYTES, field="gpu_spec")
    else:
        data = userfiles.load_yaml(path, max_bytes=GPU_SPEC_MAX_BYTES, field="gpu_spec")
    return gpu_from_fields(Fields(data, path=shown))


def _known(f: Fields, keys: tuple[str, ...]) -> None:
    unknown = sorted(str(k) for k in set(f.data) - set(keys))
    if unknown:
        raise f.fail(unknown[0], f"unknown field (known: {', '.join(keys)})")


__all__ = ["FIELDS", "GPU_SPEC_MAX_BYTES", "gpu_from_fields", "read_gpu_spec"]
