"""Smoke test of bench/gpu_gemm.py --tiny on the CPU (Triton's interpreter): it runs and writes a report naming the
machine, the tilings it compared, and per shape and row count each tiling's time and its distance from production's
tiling (float32 here: a different K order rounds differently, within float32's noise). No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (tox installs it for the kernel tests)")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_gemm.py"


def test_tiny_run_writes_a_complete_report(tmp_path):
    out = tmp_path / "gemm.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    args = [sys.executable, str(SCRIPT), "--tiny", "--rows", "1,3", "--out", str(out)]
    run = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["machine"]["cpu_count"] and report["copy_bandwidth"]["gb_per_s"] > 0
    tilings = set(report["tilings"])
    assert "current" in tilings and len(tilings) > 1
    assert [(r["shape"], r["m"]) for r in report["rows"]] == [("a", 1), ("a", 3), ("b", 1), ("b", 3)]
    for row in report["rows"]:
        assert row["weight_bound_ms"] > 0 and row["cublas_ms"] > 0
        assert all(row[f"{t}_ms"] > 0 for t in tilings)
        assert all(row[f"{t}_max_abs_vs_current"] < 1e-4 for t in tilings)
