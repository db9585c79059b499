"""Shared by the benchmarks: machine and versions, measured CPU copy and matmul rates, and the bound they imply."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import time
from pathlib import Path

import torch


def measure_copy_bandwidth(megabytes: int = 512, repeats: int = 5) -> dict:
    """Best-of-N torch copy of a large float32 tensor; bytes counted as read + write (STREAM 'copy')."""
    n = megabytes * (1 << 20) // 4
    src = torch.randn(n)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return {"tensor_bytes": n * 4, "repeats": repeats, "best_seconds": best, "gb_per_s": 2 * n * 4 / best / 1e9}


def measure_matmul_rate(size: int = 1024, repeats: int = 5) -> dict:
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return {
        "shape": [size, size, size],
        "dtype": "float32",
        "best_seconds": best,
        "gflop_per_s": 2 * size**3 / best / 1e9,
    }


def versions() -> dict:
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "deepinfer": version("deepinfer"),
        "safetensors": version("safetensors"),
    }


def machine() -> dict:
    model_name = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model_name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "node": platform.node(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": model_name,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "torch_num_threads": torch.get_num_threads(),
    }


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


# ---- bound ----------------------------------------------------------------------------------------


def model_bytes(checkpoint: Path) -> dict:
    """Parameter counts from the checkpoint's tensors (float32: 4 bytes each); MTP layers excluded."""
    from safetensors import safe_open

    config = json.loads((checkpoint / "config.json").read_text())
    layers = config["num_hidden_layers"]
    counts = {"embedding": 0, "lm_head": 0, "routed_experts": 0, "other": 0, "mtp_excluded": 0}
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                numel = 1
                for d in f.get_slice(name).get_shape():
                    numel *= d
                parts = name.split(".")
                if len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= layers:
                    counts["mtp_excluded"] += numel
                elif name == "model.embed_tokens.weight":
                    counts["embedding"] += numel
                elif name == "lm_head.weight":
                    counts["lm_head"] += numel
                elif ".mlp.experts." in name:
                    counts["routed_experts"] += numel
                else:
                    counts["other"] += numel
    total = counts["embedding"] + counts["lm_head"] + counts["routed_experts"] + counts["other"]
    experts, top_k = config["n_routed_experts"], config["num_experts_per_tok"]
    return {"config": config, "counts": counts, "total": total, "experts": experts, "top_k": top_k}


def bound(sizes: dict, copy: dict, matmul: dict, workload: dict) -> dict:
    """Lower bounds on the run's time: each forward step must read the weights it uses once."""
    cfg, counts = sizes["config"], sizes["counts"]
    batch, new, layers = workload["num_prompts"], workload["max_new_tokens"], cfg["num_hidden_layers"]
    mean_prompt = workload["mean_prompt_len"]
    # weights read per step: everything but the embedding table (only B rows of it are gathered), all
    # routed experts (at batch >= 16 with top-k of E, nearly all experts get a token: see the fraction)
    tied = cfg.get("tie_word_embeddings", False)
    weights_read = (
        (counts["lm_head"] or (counts["embedding"] if tied else 0)) + counts["routed_experts"] + counts["other"]
    )
    expected_touched = 1 - (1 - sizes["top_k"] / sizes["experts"]) ** batch  # under uniform routing
    bytes_per_param = 4
    # MLA latent cache: (kv_lora + rope) floats per token per layer, read once per decode step per sequence
    latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    mean_ctx = mean_prompt + new / 2
    kv_bytes_per_decode_step = batch * mean_ctx * latent * layers * bytes_per_param
    weight_bytes_per_step = weights_read * bytes_per_param
    bw = copy["gb_per_s"] * 1e9
    # minimum forward passes: one prefill (emits token 1) + (new - 1) decode steps
    steps = new
    memory_s = steps * weight_bytes_per_step / bw + (new - 1) * kv_bytes_per_decode_step / bw
    # flops: 2 x active params per token (top-k experts + shared + dense + attention projections + lm_head)
    expert_params_each = counts["routed_experts"] / sizes["experts"]
    active = weights_read - counts["routed_experts"] + expert_params_each * sizes["top_k"]
    tokens_processed = batch * (mean_prompt + new - 1)
    flops = 2 * active * tokens_processed
    compute_s = flops / (matmul["gflop_per_s"] * 1e9)
    return {
        "note": (
            "ESTIMATES. Memory bound = forward steps x bytes read per step / measured copy bandwidth; "
            "bytes per step assume every routed expert is read (all experts touched at batch >= 16), fp32 "
            "weights excluding the embedding table (a gather of B rows), plus the MLA latent KV at the mean "
            "context for decode steps. Compute bound = 2 x active params x tokens / measured 1024^3 fp32 "
            "matmul rate (ignores attention score flops). On a 2-core CPU with a model this small, per-step "
            "Python/dispatch overhead, not bandwidth, dominates; the fraction shows how far from the bound."
        ),
        "params_total_excluding_mtp": sizes["total"],
        "params_by_kind": counts,
        "params_read_per_step_estimate": weights_read,
        "weight_bytes_per_step_estimate": weight_bytes_per_step,
        "assumption_all_experts_touched": True,
        "expected_fraction_of_experts_touched_uniform_routing": expected_touched,
        "kv_latent_bytes_per_decode_step_estimate": kv_bytes_per_decode_step,
        "active_params_per_token_estimate": active,
        "min_forward_steps": steps,
        "measured_copy_bandwidth_gb_per_s": copy["gb_per_s"],
        "measured_matmul_gflop_per_s": matmul["gflop_per_s"],
        "memory_bound_seconds_estimate": memory_s,
        "compute_bound_seconds_estimate": compute_s,
        "lower_bound_seconds_estimate": max(memory_s, compute_s),
        "bound_output_tokens_per_s_estimate": batch * new / max(memory_s, compute_s),
        "memory_bound_step_seconds_estimate": weight_bytes_per_step / bw,
    }


def write_report(out: str | Path, benchmark: str, argv: list[str] | None, fields: dict) -> dict:
    """Write a benchmark's JSON report to `out`: its name, the command that ran it (`argv`: main's, None for the
    process's own), the time, the machine and package versions, then `fields`. Returns the report."""
    import sys

    script = f"bench/{benchmark}.py"
    report = {
        "benchmark": benchmark,
        "command": " ".join(["python", script, *(sys.argv[1:] if argv is None else argv)]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        "versions": versions(),
        **fields,
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2) + "\n")
    return report
