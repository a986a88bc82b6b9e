"""The GPU catalog against aiconfigurator-core's systems, and `--gpu-spec FILE` through the CLI."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvtune.cli import cli
from kvtune.domain.fields import Fields
from kvtune.errors import KvtuneError
from kvtune.gpu_spec import gpu_from_fields, read_gpu_spec
from kvtune.hardware import GPUS, MATMUL_DTYPES, find_gpu

SPECS = Path(__file__).parents[1] / "data" / "gpu-specs"
COMMON_WITHOUT_SILICON = ["H20", "L20", "GH200", "A800-80GB", "H800", "MI300X", "MI325X"]


def _aic_systems() -> Path | None:
    spec = importlib.util.find_spec("aiconfigurator_core")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "systems"


def test_every_gpu_aiconfigurator_measured_is_in_the_catalog_with_its_figures():
    systems = _aic_systems()
    if systems is None:
        pytest.skip("aiconfigurator-core is not installed")
    measured = sorted(d.name for d in (systems / "data").iterdir()
                      if d.is_dir() and any(p.name != ".gitkeep" for p in d.iterdir()))
    assert len(measured) >= 10  # 0.12.0: a100_sxm b200_sxm b300_sxm b60 gb200 gb300 h100_sxm h200_sxm l40s rtx_pro…
    by_system = {g.silicon_system: g for g in GPUS.values() if g.silicon_system}
    assert sorted(by_system) == measured
    for name, gpu in by_system.items():
        system = yaml.safe_load((systems / f"{name}.yaml").read_text())["gpu"]
        assert gpu.hbm_bandwidth_bytes_per_s == pytest.approx(system["mem_bw"], rel=0.04), name
        assert gpu.bf16_dense_flops == pytest.approx(system["bfloat16_tc_flops"], rel=0.01), name
        # aiconfigurator states fp8 = bf16 where a GPU has no FP8 tensor path (B60); the catalog says None
        if system.get("fp8_tc_flops", 0) > system["bfloat16_tc_flops"]:
            assert gpu.fp8_dense_flops == pytest.approx(system["fp8_tc_flops"], rel=0.01), name
        # within 3% of its memory figure (it rounds some to a GiB count: 80 GiB for the H100's 79.65)
        assert gpu.memory_bytes == pytest.approx(system["mem_capacity"], rel=0.075), name


@pytest.mark.parametrize("name", COMMON_WITHOUT_SILICON)
def test_common_gpus_without_silicon_data_have_roofline_figures(name):
    gpu = find_gpu(name)
    assert gpu.silicon_system is None
    assert gpu.bf16_dense_flops and gpu.int8_dense_ops
    if name != "A800-80GB":  # Ampere: no FP8 tensor path
        assert gpu.fp8_dense_flops >= gpu.bf16_dense_flops


@pytest.mark.parametrize(("alias", "name", "system"), [
    ("h100", "H100-80GB", "h100_sxm"), ("h200", "H200", "h200_sxm"), ("a100", "A100-80GB", "a100_sxm"),
    ("b200", "B200", "b200_sxm"), ("gb200", "GB200", "gb200"), ("l40s", "L40S", "l40s"),
    ("rtx pro 6000", "RTX-PRO-6000", "rtx_pro_6000_server"), ("h100-pcie", "H100-PCIe", None),
    ("h20", "H20", None), ("mi325x", "MI325X", None)])
def test_silicon_system_names(alias, name, system):
    gpu = find_gpu(alias)
    assert (gpu.name, gpu.silicon_system) == (name, system)


def test_fp8_only_where_the_tensor_cores_have_it():
    assert find_gpu("a100").fp8_dense_flops is None  # Ampere: no FP8
    assert find_gpu("a100").peak_dense_flops("int8") == 624e12
    assert find_gpu("h100").peak_dense_flops("fp8") == 1979e12
    assert find_gpu("b200").peak_dense_flops("fp4") == 9000e12
    for gpu in GPUS.values():
        for dtype in MATMUL_DTYPES:
            peak = gpu.peak_dense_flops(dtype)
            assert peak is None or peak > 0


# --- --gpu-spec ------------------------------------------------------------------------------


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


@pytest.mark.parametrize("file", ["h100-nvl.yaml", "h100-nvl.json"])
def test_gpu_spec_file_reads_yaml_and_json(file):
    gpu = read_gpu_spec(SPECS / file)
    assert (gpu.name, gpu.memory_bytes, gpu.hbm_bandwidth_bytes_per_s) == ("H100-NVL", 95_830 * 2**20, 3_900 * 10**9)
    assert (gpu.bf16_dense_flops, gpu.fp8_dense_flops, gpu.int4_dense_ops) == (835.5e12, 1670.5e12, None)
    assert gpu.silicon_system is None and gpu.origin.endswith(file)


def test_capacity_with_a_gpu_spec_is_the_estimate_on_its_memory():
    result = run("capacity", "llama-3.1-8b", "--gpu-spec", str(SPECS / "h100-nvl.yaml"), "--json")
    assert result.exit_code == 0, result.output
    d = json.loads(result.stdout)
    assert (d["gpu"], d["gpu_memory_bytes"]) == ("H100-NVL", 95_830 * 2**20)
    same = json.loads(run("capacity", "llama-3.1-8b", "--gpu-memory", "95830MiB", "--json").stdout)
    assert d["num_blocks"] == same["num_blocks"]


def test_recommend_with_a_gpu_spec_names_it(tmp_path):
    result = run("recommend", "sample_logs/", "--model", "llama-3.1-8b", "--gpu-spec", str(SPECS / "h100-nvl.yaml"),
                 "--out", str(tmp_path / "deploy"))
    assert result.exit_code == 0, result.output
    rec = json.loads((tmp_path / "deploy" / "recommendation.json").read_text())
    assert rec["hardware"]["gpu"] == "H100-NVL"
    deployed = ["--deployed", str(tmp_path / "deploy" / "vllm-serve.sh"),
                "--deployed", str(tmp_path / "deploy" / "gateway.yaml")]
    check = run("check", "sample_logs/", "--model", "llama-3.1-8b", "--gpu-spec", str(SPECS / "h100-nvl.yaml"),
                *deployed)
    assert check.exit_code == 0, check.output
    from_file = run("check", str(tmp_path / "deploy" / "recommendation.json"), *deployed,
                    "--gpu-spec", str(SPECS / "h100-nvl.yaml"))
    assert from_file.exit_code == 0, from_file.output


def test_gpu_spec_with_gpu_is_refused():
    result = run("capacity", "llama-3.1-8b", "--gpu", "h100", "--gpu-spec", str(SPECS / "h100-nvl.yaml"))
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "Error: --gpu-spec: give --gpu-spec FILE or --gpu, not both: the file names the GPU and its memory")


@pytest.mark.parametrize(("text", "error"), [
    ("name: X\nmemory: 80\nbandwidth_gb_s: 3900\ndense_tflops: {bf16: 835}\n",
     "memory: expected a size with a unit such as 80GB or 79.2GiB, got 80"),
    ("name: X\nmemory: 80GB\nbandwith_gb_s: 3900\ndense_tflops: {bf16: 835}\n",
     "bandwith_gb_s: unknown field (known: name, memory, bandwidth_gb_s, dense_tflops, vendor)"),
    ("name: X\nmemory: 80GB\nbandwidth_gb_s: 3900\ndense_tflops: {fp8: 835}\n", "dense_tflops.bf16: missing"),
    ("name: X\nmemory: 80GB\nbandwidth_gb_s: 3900\ndense_tflops: {bf16: 835, fp16: 835}\n",
     "dense_tflops.fp16: unknown field (known: bf16, fp8, int8, int4, fp4)"),
    ("name: X\nmemory: 80GB\nbandwidth_gb_s: 0\ndense_tflops: {bf16: 835}\n", "bandwidth_gb_s: must be at least 1, got 0"),
    ("name: X\nmemory: 80GB\nbandwidth_gb_s: 3350000000000\ndense_tflops: {bf16: 835}\n",
     "bandwidth_gb_s: must be at most 1e+06, got 3350000000000"),
    ("memory: 80GB\nbandwidth_gb_s: 3900\ndense_tflops: {bf16: 835}\n", "name: missing"),
])
def test_bad_gpu_spec_is_one_line_naming_file_and_field(tmp_path, text, error):
    path = tmp_path / "gpu.yaml"
    path.write_text(text)
    result = run("capacity", "llama-3.1-8b", "--gpu-spec", str(path))
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [f"Error: {path}: {error}"]


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20), st.floats(allow_nan=True),
                     st.text(max_size=12))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.sampled_from(["bf16", "fp8", "x"]), inner, max_size=3), max_leaves=6)
_good = {"name": "G", "memory": "80GB", "bandwidth_gb_s": 3000, "dense_tflops": {"bf16": 900, "fp8": 1800}}


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from([*_good, "vendor", "extra"]), _values, max_size=6),
       st.sampled_from([*_good, "vendor"]))
@example({"bandwidth_gb_s": 2.225073858507203e-309}, "bandwidth_gb_s")  # found: 0 B/s once converted
def test_any_spec_object_is_a_gpu_or_one_input_error(data, keep):
    """Fuzzed spec objects (good ones with one field broken, or anything): a Gpu with positive
    figures, or a KvtuneError naming a field, never another exception."""
    for candidate in (data, {**_good, **{k: v for k, v in data.items() if k == keep}}):
        try:
            gpu = gpu_from_fields(Fields(candidate, path="gpu.yaml"))
        except KvtuneError as exc:
            assert exc.path == "gpu.yaml" and "\n" not in str(exc)
            continue
        assert gpu.memory_bytes > 0 and gpu.hbm_bandwidth_bytes_per_s > 0 and gpu.bf16_dense_flops > 0


def test_no_alias_names_two_gpus():
    names: dict[str, str] = {}
    for gpu in GPUS.values():
        for alias in (gpu.name, *gpu.aliases):
            key = "".join(alias.lower().replace("-", "").replace("_", "").split())
            assert names.setdefault(key, gpu.name) == gpu.name, alias
            assert find_gpu(alias) is gpu
