"""Smoke tests of bench/gpu_decode.py --model v4 | v41 with --tiny on the CPU: each runs and writes a complete
report naming the model, its systems, batches and bounds (with what the bounds count).

No timing is asserted (DESIGN.md §7). DeepSeek-V4: our engine and transformers give the same greedy tokens on
the same weights; DeepSeek-V4.1 has no transformers baseline, which the report says.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_decode.py"
# one intra-op thread: a tiny model, and a second OpenMP thread on a shared 2-core machine makes every small op
# wait for a descheduled thread (offline_throughput's and prefix_replay's default: bench/README.md)
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
TOP_LEVEL = {"model", "machine", "versions", "backend", "systems", "hf", "config", "params", "cache", "workload"}
TOP_LEVEL |= {"measurements", "decode", "prefill", "bound", "comparisons", "hf_agreement", "plot"}


def _run(tmp_path: Path, model: str, *extra: str) -> dict:
    out = tmp_path / f"{model}.json"
    args = ["--tiny", "--model", model, "--out", str(out), "--plot", str(tmp_path / f"{model}.png")]
    args += ["--prefill-repeats", "1", *extra]
    run = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=ENV)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


def _check_complete(report: dict, model: str, systems: set[str]) -> None:
    assert TOP_LEVEL <= set(report)
    assert report["model"]["name"] == model and report["model"]["layer_types"]
    assert report["machine"]["cpu_count"] and report["versions"]["torch"]
    batches = [str(b) for b in report["workload"]["batches"]]
    assert set(report["decode"]) == systems and set(report["prefill"]) == systems
    for system in systems:
        assert set(report["decode"][system]) == set(batches)
        for result in report["decode"][system].values():
            assert {"ms_per_step", "tokens_per_s", "fraction_of_bound", "fraction_of_memory_bound"} <= set(result)
            if system == "ours_default":  # transformers' is a difference of two timings: noise can make it < 0
                assert result["ms_per_step"] > 0 and result["fraction_of_bound"] > 0
        assert report["prefill"][system]["tokens_per_s"] > 0 and report["prefill"][system]["fraction_of_bound"] > 0
    bound = report["bound"]
    for b in batches:
        step = bound["decode"][b]
        assert step["memory_bound_ms"] > 0 and step["bound_ms"] >= step["memory_bound_ms"]
        assert step["weight_bytes"] > 0 and step["kv_bytes"] > 0 and step["flops"] > 0
        assert step["kv_bytes"] == sum(step["kv_bytes_by_cache"].values())
    assert bound["prefill"]["flops"] > bound["prefill"]["attention_flops"] > 0
    counted = bound["counted"]
    assert {"weights", "caches", "flops", "not_counted", "mean_decode_context"} <= set(counted)
    reads = counted["per_sequence_cache_reads"]
    assert {"window", "compressed", "index_keys", "compressor_state"} <= set(reads)
    assert all(r["bytes"] > 0 and r["read_by"] for r in reads.values())
    layers = report["cache"]["layers"]
    assert len(layers) == len(report["model"]["layer_types"]) and report["cache"]["sequence_slot_bytes"] > 0
    assert report["params"]["bytes_total"] > 0 and report["params"]["active_params_per_token"] > 0
    assert report["measurements"]["copy_bandwidth"]["gb_per_s"] > 0
    assert report["batch_invariant"]["measured"] is False and report["fp8"]["measured"] is False
    assert report["batch_invariant"]["reason"]  # the cpu backend does not claim batch invariance: it says so


def test_gpu_decode_v4_tiny_writes_a_complete_report(tmp_path):
    report = _run(tmp_path, "v4", "--accelerator", "cpu")
    _check_complete(report, "v4", {"ours_default", "hf"})
    assert report["model"]["layer_types"] == [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ]
    assert report["hf"]["available"] and report["hf"]["class"] == "DeepseekV4ForCausalLM"
    assert report["cache"]["specs_from"] == "model.cache_specs"
    agreement = report["hf_agreement"]
    assert agreement["passed"] and agreement["hf_agreement"] == 1.0, agreement
    for b in map(str, report["workload"]["batches"]):
        assert report["comparisons"]["token_match_vs_hf"][b]["identical_token_fraction"] == 1.0
        assert report["comparisons"]["speedup_vs_hf"][b] > 0
    # CSA reads the indexer's top-k of its entries, HCA all of them; both hold compressor states
    reads = report["bound"]["counted"]["per_sequence_cache_reads"]
    assert reads["index_keys"]["read_by"] == [1, 3] and reads["compressed"]["read_by"] == [1, 2, 3]


def test_gpu_decode_v41_tiny_says_it_has_no_transformers_baseline(tmp_path):
    report = _run(tmp_path, "v41", "--accelerator", "cpu", "--profile", "--profile-batches", "1")
    _check_complete(report, "v41", {"ours_default"})
    assert report["hf"] == {
        "available": False,
        "reason": "transformers: no deepseek_v41 in 5.24; the reference is not on pip",
    }
    assert report["hf_agreement"] is None and report["comparisons"]["speedup_vs_hf"] == {}
    assert report["model"]["compress_ratios"] == [0, 2, 2, 1, 1]
    assert report["model"]["kv_source_layer_ids"] == [1, 3] and report["model"]["engram_layer_ids"] == []
    # a group's compressed entries live on its kv source; every attending layer of the group reads them
    reads = report["bound"]["counted"]["per_sequence_cache_reads"]
    assert reads["compressed"]["held_by"] == [1, 3] and reads["compressed"]["read_by"] == [1, 2, 3, 4]
    assert report["profile"][0]["top"] and report["profile"][0]["system"] == "ours_default"


def test_gpu_decode_v4_skip_ours_bounds_from_the_declared_caches(tmp_path):
    report = _run(tmp_path, "v4", "--skip-ours")
    _check_complete(report, "v4", {"hf"})
    assert report["backend"] is None and report["cache"]["specs_from"].startswith("meta declarations")


@pytest.mark.parametrize("model", ["v4", "v41"])
def test_gpu_decode_measures_the_released_weight_formats(tmp_path, monkeypatch, model):
    """--quantized end to end on the CPU: the cpu backend, declaring mxfp4 and fp8_block (its ops dequantize on
    the fly): FP4-expert, dequantized-twin and FP8-projection models measured, the FP4 model against its own
    bound, greedy agreement of the FP4 model with its dequantized twin reported."""
    import dataclasses
    import importlib

    from deepinfer_core.backend.resolve import resolve_backend

    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    gpu_decode, quant = importlib.import_module("gpu_decode"), importlib.import_module("_gpu_v4_quant")

    def capable(entry, dtype):
        backend = resolve_backend(entry, dtype=dtype)
        formats = dataclasses.replace(backend.capabilities, weight_formats=("fp8_block", "mxfp4"))
        return dataclasses.replace(backend, capabilities=formats), None

    monkeypatch.setattr(quant, "quant_backend", capable)
    out = tmp_path / "q.json"
    args = ["--tiny", "--model", model, "--accelerator", "cpu", "--out", str(out), "--plot", str(tmp_path / "q.png")]
    profiled = ["--profile", "--profile-batches", "1", "--profile-system", "ours_fp4_experts,ours_fp4_dequantized"]
    assert gpu_decode.main([*args, "--skip-hf", "--skip-batch-invariant", "--prefill-repeats", "1", "--quantized",
                            *profiled]) == 0  # fmt: skip
    report = json.loads(out.read_text())
    systems = [(p["system"], p["batch"]) for p in report["profile"]]
    assert systems == [("ours_fp4_experts", 1), ("ours_fp4_dequantized", 1)]
    quantized = report["quantized"]
    assert quantized["measured"] is True
    held = quantized["weight_bytes_by_format"]
    assert "mxfp4" in held["ours_fp4_experts"] and "fp8_block" in held["ours_fp8_projections"]
    assert "mxfp4" not in held["ours_fp4_dequantized"] and "mxfp4" not in held["ours_default"]
    assert {"mxfp4", "fp8_block"} <= set(held["ours_native"])
    for b in map(str, report["workload"]["batches"]):
        result = report["decode"]["ours_fp4_experts"][b]
        own = report["bound"]["decode_fp4_experts"][b]
        assert own["weight_bytes"] < report["bound"]["decode"][b]["weight_bytes"]  # 4.25-bit experts
        assert result["fraction_of_own_bound"] == pytest.approx(own["bound_ms"] / result["ms_per_step"])
        assert quantized["fp4_experts_speedup_vs_bf16_experts"][b] > 0
        assert quantized["fp8_projections_speedup_vs_bf16"][b] > 0
        assert quantized["native_speedup_vs_bf16"][b] > 0
        # float32 here, ops dequantizing exactly: the FP4-held model computes its twin's values
        assert quantized["token_match_fp4_vs_dequantized"][b]["identical_token_fraction"] == 1.0


def test_expert_kernel_share_is_amdahls_bound_on_the_profiles(monkeypatch):
    """The attainable speedup of FP4 experts, by hand: a 10 ms bf16-expert step of which 4 ms are the expert kernels,
    FP4 expert bytes that take 1 ms at the copy bandwidth -> 10 / (6 + 1)."""
    import importlib

    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    quant = importlib.import_module("_gpu_v4_quant")
    per_expert = 1e9 / quant.MXFP4_BYTES_PER_WEIGHT  # params: 1 GB of MXFP4 an expert
    kernels = [{"name": "_gate_up_kernel", "ms_per_step": 3.0}, {"name": "_down_kernel", "ms_per_step": 1.0},
               {"name": "attention", "ms_per_step": 6.0}]  # fmt: skip
    fp4_kernels = [{**k, "ms_per_step": k["ms_per_step"] / 2 if k["name"] != "attention" else 6.0} for k in kernels]
    report = {
        "profile": [
            {"system": "ours_fp4_dequantized", "batch": 4, "total_ms_per_step": 10.0, "top": kernels},
            {"system": "ours_fp4_experts", "batch": 4, "total_ms_per_step": 8.0, "top": fp4_kernels},
        ],
        "params": {"params_per_expert": per_expert, "moe_layers": 2, "bytes_per_expert": 2 * per_expert},
        "measurements": {"copy_bandwidth": {"gb_per_s": 4000.0}},  # 4 GB/ms
        "bound": {
            "decode": {"4": {"expected_experts_touched_per_layer": 2.0, "bound_ms": 7.0}},
            "decode_fp4_experts": {"4": {"bound_ms": 3.5}},
        },  # fmt: skip
    }
    row = quant.expert_kernel_share(report)["by_batch"]["4"]
    assert row["expert_share_of_bf16_step"] == pytest.approx(0.4)
    assert row["fp4_expert_kernel_speedup"] == pytest.approx(2.0)
    assert row["fp4_expert_bytes_bound_ms"] == pytest.approx(1.0)  # 2 layers x 2 experts x 1 GB / 4 GB per ms
    assert row["fp4_expert_kernels_fraction_of_bound"] == pytest.approx(0.5)
    assert row["attainable_speedup_with_fp4_experts_at_bound"] == pytest.approx(10 / 7)
    assert row["attainable_fraction_of_own_bound"] == pytest.approx(3.5 / 7)
    assert row["speedup_with_every_kernel_at_bound"] == pytest.approx(7.0 / 3.5)
    report["profile"][0]["top"] = kernels[2:]  # no expert kernels by these names: nothing to say
    assert quant.expert_kernel_share(report) is None
