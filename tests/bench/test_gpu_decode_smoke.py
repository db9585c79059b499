"""Smoke test of bench/gpu_decode.py with --tiny on the CPU: it runs and writes a complete report.

No timing is asserted (DESIGN.md §7): only that the script works end to end, the JSON has its fields
with positive numbers, and our engine and transformers produce the same greedy tokens on the same weights.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer_core.backend.resolve import resolve_backend

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_decode.py"
# one intra-op thread: a tiny model, and a second OpenMP thread on a shared 2-core machine makes every small op
# wait for a descheduled thread (offline_throughput's and prefix_replay's default: bench/README.md)
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def test_gpu_decode_tiny_writes_a_complete_report(tmp_path):
    out, plot = tmp_path / "x.json", tmp_path / "x.png"
    args = ["--tiny", "--accelerator", "cpu", "--out", str(out), "--plot", str(plot), "--profile"]
    args += ["--prefill-repeats", "1", "--profile-batches", "1"]
    run = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=ENV)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    expected = {"machine", "versions", "backend", "config", "params", "workload", "measurements", "bound", "decode"}
    expected |= {"prefill", "comparisons", "hf_agreement", "batch_invariant", "profile", "plot"}
    expected |= {"fp8", "fp8_agreement"}
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
    # nor the fp8_block weight format: the FP8 system is skipped with the reason, its bound still computed
    assert report["fp8"]["measured"] is False and "weight_formats" in report["fp8"]["reason"]
    assert "ours_fp8" not in report["decode"] and "ours_fp8" not in report["prefill"]
    assert report["comparisons"]["fp8_over_default_throughput"] == {}
    fp8_bytes = report["fp8"]["params"]["bytes_total"]
    assert 0 < fp8_bytes < report["params"]["bytes_total"] and report["fp8"]["params"]["fp8_bytes"] > 0
    assert all(
        0 < report["bound"]["decode_fp8"][b]["weight_bytes"] < report["bound"]["decode"][b]["weight_bytes"]
        for b in batches
    )
    # the FP8 check runs on a copy of the cpu backend declaring the format (its ops dequantize): exact
    fp8_check = report["fp8_agreement"]
    assert fp8_check["exact_expected"] and fp8_check["passed"] and fp8_check["fp8_agreement"] == 1.0, fp8_check
    assert fp8_check["fp8_held"]["tensors"] > 0
    assert report["profile"][0]["top"] and report["profile"][0]["total_ms_per_step"] > 0
    for result in report["decode"]["ours_default"].values():  # every decode step's time, in order
        assert len(result["step_ms"]) == result["decode_steps"] and min(result["step_ms"]) > 0
        assert result["gpu"] == {}  # nvidia-smi's state only on CUDA
    if report["plot"]["written"]:
        assert plot.stat().st_size > 0
    else:
        assert "matplotlib" in report["plot"]["reason"]


def test_gpu_decode_measures_batch_invariant_mode_where_the_backend_has_one(tmp_path):
    pytest.importorskip("deepinfer_rowwise_cpu")
    out = tmp_path / "x.json"
    args = ["--tiny", "--accelerator", "rowwise_cpu", "--out", str(out), "--batches", "2", "--prefill-repeats", "1"]
    args += ["--profile", "--profile-batches", "2", "--profile-system", "ours_batch_invariant"]
    run = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=ENV)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["batch_invariant"]["measured"] is True
    assert report["decode"]["ours_batch_invariant"]["2"]["ms_per_step"] > 0
    assert report["comparisons"]["batch_invariant_over_default_throughput"]["2"] > 0
    assert report["comparisons"]["token_match_batch_invariant_vs_default"]["2"]["identical_token_fraction"] == 1.0
    profile = report["profile"][0]
    assert profile["system"] == "ours_batch_invariant" and profile["batch"] == 2 and profile["top"]


@pytest.mark.usefixtures("one_torch_thread")  # in this process: see ENV
def test_gpu_decode_measures_the_fp8_model_where_the_backend_takes_fp8_weights(tmp_path, monkeypatch):
    """The FP8 path end to end on the CPU: the cpu backend, declared fp8_block (its ops dequantize on the fly)."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    gpu_decode = importlib.import_module("gpu_decode")

    def capable(entry, dtype):
        backend = resolve_backend(entry, dtype=dtype)
        formats = dataclasses.replace(backend.capabilities, weight_formats=("fp8_block",))
        return dataclasses.replace(backend, capabilities=formats), None

    monkeypatch.setattr(gpu_decode, "fp8_backend", capable)
    out = tmp_path / "x.json"
    args = ["--tiny", "--accelerator", "cpu", "--out", str(out), "--plot", str(tmp_path / "x.png"), "--skip-hf"]
    assert gpu_decode.main([*args, "--prefill-repeats", "1"]) == 0
    report = json.loads(out.read_text())
    fp8 = report["fp8"]
    assert fp8["measured"] is True and fp8["reason"] is None
    assert fp8["held"]["tensors"] > 0 and fp8["held"]["bytes"] == fp8["params"]["fp8_bytes"]
    for b in map(str, report["workload"]["batches"]):
        result, bound = report["decode"]["ours_fp8"][b], report["bound"]["decode_fp8"][b]
        assert result["ms_per_step"] > 0 and result["decode_steps"] == report["workload"]["new_tokens"] - 1
        assert result["fraction_of_bound"] == pytest.approx(bound["bound_ms"] / result["ms_per_step"])
        assert report["comparisons"]["fp8_over_default_throughput"][b] > 0
        assert report["comparisons"]["token_match_fp8_vs_default"][b]["sequences"] == int(b)
    assert report["prefill"]["ours_fp8"]["tokens_per_s"] > 0
    assert report["comparisons"]["fp8_over_default_prefill_throughput"] > 0
