"""benchmarks/sim_validation.py --short against the real vLLM (CPU): one trace, one load, direct
and through the gateway, one seed, a 12 s timing calibration; `kvtune simulate`'s prediction next
to `kvtune bench`'s measure.

The harness must produce both figures for both modes; the prediction must be within 50 % of
the measure on output throughput. The validation's tight targets (10 %, …) are printed, not
asserted here: `python benchmarks/sim_validation.py` reports them over every trace, load and seed.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCRIPT = REPO / "benchmarks" / "sim_validation.py"


# The measured side is a wall-clock throughput of the real vLLM: beside CI's other test process the
# gateway row measured 91 tok/s (10 retried 429s) against 138 predicted, 51 % against the 50 % bound
# (2026-12-07); the prediction is the same either way, so it is measured on a quiet host.
@pytest.mark.quiet
def test_short_validation_predicts_and_measures_both_modes(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--short", "--json", "--keep", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout)
    rows = {r["mode"]: r for r in summary["rows"]}
    assert set(rows) == {"direct", "gateway"}
    for mode, row in rows.items():
        for side in ("predicted", "measured"):
            figures = row[side]
            assert figures["output_tokens_per_s"] > 0, (mode, side, figures)
            assert figures["requests_per_s"] > 0, (mode, side, figures)
            assert figures["preemptions"] is not None, (mode, side, figures)
            assert figures["e2e_p50_ms"] is not None and figures["ttft_p50_ms"] is not None, (mode, side, figures)
        assert row["measured"]["completed"] == summary["setup"]["requests"], (mode, row["measured"])
        error = row["checks"]["throughput"]["error"]
        print(f"\n{mode}: output tok/s predicted {row['predicted']['output_tokens_per_s']:.0f}, measured "
              f"{row['measured']['output_tokens_per_s']:.0f} ({error:+.0%}); checks "
              f"{ {k: c['passed'] for k, c in row['checks'].items()} }")
        assert abs(error) <= 0.5, (mode, row["predicted"], row["measured"])
    assert "gateway_ratio" in rows["gateway"]["checks"]
    print(json.dumps(summary["targets"], indent=1))
