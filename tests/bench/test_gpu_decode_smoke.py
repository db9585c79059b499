"""Smoke test of bench/gpu_decode.py with --tiny on the CPU: it runs and writes a complete report.

No timing is asserted (DESIGN.md §7): only that the script works end to end, the JSON has its fields
with positive numbers, and our engine and transformers produce the same greedy tokens on the same weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_decode.py"


def test_gpu_decode_tiny_writes_a_complete_report(tmp_path):
    out, plot = tmp_path / "x.json", tmp_path / "x.png"
    args = ["--tiny", "--accelerator", "cpu", "--out", str(out), "--plot", str(plot), "--profile"]
    args += ["--prefill-repeats", "1", "--profile-batches", "1"]
    run = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    expected = {"machine", "versions", "backend", "config", "params", "workload", "measurements", "bound", "decode"}
    expected |= {"prefill", "comparisons", "hf_agreement", "batch_invariant", "profile", "plot"}
    assert expected <= set(report)
    assert report["versions"]["torch"] and report["versions"]["transformers"]
    assert report["backend"]["name"] == "cpu"

    agreement = report["hf_agreement"]
    assert agreement["passed"] and agreement["hf_agreement"] == 1.0, agreement

    batches = [str(b) for b in report["workload"]["batches"]]
    for system in ("ours_default", "hf"):
        assert set(report["decode"][system]) == set(batches)
        for result in report["decode"][system].values():
            assert result["ms_per_step"] > 0 and result["tokens_per_s"] > 0 and result["fraction_of_bound"] > 0
    assert all(
        r["decode_steps"] == report["workload"]["new_tokens"] - 1 for r in report["decode"]["ours_default"].values()
    )
    for system in ("ours_default", "hf"):
        assert report["prefill"][system]["tokens_per_s"] > 0 and report["prefill"][system]["tflop_per_s"] > 0
    for b in batches:
        bound = report["bound"]["decode"][b]
        assert bound["memory_bound_ms"] > 0 and bound["weight_bytes"] > 0 and bound["kv_bytes"] > 0
        assert report["comparisons"]["token_match_vs_hf"][b]["identical_token_fraction"] == 1.0
    assert report["bound"]["prefill"]["flops"] > 0
    assert (
        report["measurements"]["copy_bandwidth"]["gb_per_s"] > 0 and report["measurements"]["gemm"]["tflop_per_s"] > 0
    )

    # the cpu backend offers no batch-invariant mode: recorded, not a crash
    assert report["batch_invariant"]["measured"] is False and report["batch_invariant"]["reason"]
    assert report["profile"][0]["top"] and report["profile"][0]["total_ms_per_step"] > 0
    if report["plot"]["written"]:
        assert plot.stat().st_size > 0
    else:
        assert "matplotlib" in report["plot"]["reason"]


def test_gpu_decode_measures_batch_invariant_mode_where_the_backend_has_one(tmp_path):
    pytest.importorskip("deepinfer_rowwise_cpu")
    out = tmp_path / "x.json"
    args = ["--tiny", "--accelerator", "rowwise_cpu", "--out", str(out), "--batches", "2", "--prefill-repeats", "1"]
    run = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["batch_invariant"]["measured"] is True
    assert report["decode"]["ours_batch_invariant"]["2"]["ms_per_step"] > 0
    assert report["comparisons"]["batch_invariant_over_default_throughput"]["2"] > 0
    assert report["comparisons"]["token_match_batch_invariant_vs_default"]["2"]["identical_token_fraction"] == 1.0
