"""Smoke test of bench/gpu_quant_kernels.py --tiny on the CPU (Triton's interpreter): it runs and writes a report
naming the machine and, per batch / projection and tiling, a time, a bound and the distance from the same values in
float32 without the quantized kernels (float32 here: the MXFP4 and FP8 tiles are the dequantized values exactly, so
the distance is float32 noise). No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (tox installs it for the kernel tests)")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_quant_kernels.py"


def test_tiny_run_writes_a_complete_report(tmp_path):
    out = tmp_path / "quant.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    run = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--out", str(out)], capture_output=True, text=True,
                         timeout=300, env=env)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["machine"]["cpu_count"] and report["copy_bandwidth"]["gb_per_s"] > 0
    ffn_tilings, gemm_tilings = (
        report["ffn_tilings_bm_bn_bk_warps_stages"],
        report["gemm_tilings_bm_bn_bk_warps_waves_stages"],
    )
    assert {"default", "invariant"} <= set(ffn_tilings) & set(gemm_tilings) and len(ffn_tilings) > 2
    assert [r["batch"] for r in report["expert_ffn"]] == [1, 3]
    for row in report["expert_ffn"]:
        assert row["rows"] == 2 * row["batch"] and 0 < row["mxfp4_bound_ms"] < row["bfloat16_bound_ms"]
        for t in ffn_tilings:
            assert row[f"fp4_{t}_ms"] > 0 and row[f"fp4_{t}_max_abs_vs_bf16"] < 1e-4
    assert [(r["shape"], r["m"]) for r in report["fp8_projections"]] == [("a", 1), ("a", 5)]
    for row in report["fp8_projections"]:
        assert row["cublas_bf16_ms"] > 0 and row["fp8_bound_ms"] < row["bf16_bound_ms"]
        assert all(row[f"fp8_{t}_ms"] > 0 and row[f"fp8_{t}_max_abs_vs_bf16"] < 1e-4 for t in gemm_tilings)
