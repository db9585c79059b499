"""The report of gpu_decode.py: bounds and comparisons added to the results, the stdout table and the plot."""

from __future__ import annotations

import torch
from _gpu_measure import decode_step_bound, prefill_bound, token_match

from deepinfer_core.model.config import DeepseekConfig


def summarise(report: dict, cfg: DeepseekConfig, dtype: torch.dtype) -> None:
    """Add the bounds, each result's fraction of its bound, and the cross-system comparisons to `report`."""
    work, sizes, sizes_fp8 = report["workload"], report["params"], report["fp8"]["params"]
    bw = report["measurements"]["copy_bandwidth"]["gb_per_s"] * 1e9
    peak = report["measurements"]["gemm"]["tflop_per_s"] * 1e12
    context = work["prompt_len"] + work["new_tokens"] / 2  # mean context over the decode steps
    bound = {str(b): decode_step_bound(cfg, sizes, b, context, bw, peak) for b in work["batches"]}
    prefill = prefill_bound(cfg, sizes, *work["prefill"], peak, bw)
    bound_fp8 = {str(b): decode_step_bound(cfg, sizes_fp8, b, context, bw, peak) for b in work["batches"]}
    prefill_fp8 = prefill_bound(cfg, sizes_fp8, *work["prefill"], peak, bw)
    item, dtype_name = dtype.itemsize, str(dtype).removeprefix("torch.")
    report["bound"] = {
        "note": "decode, per step: (weights read: all non-expert weights, the lm_head, and E(1 - (1 - k/E)^B) "
        "routed experts per MoE layer, the expected number touched under UNIFORM routing; plus the MLA latent KV, "
        f"B x ctx x {cfg.latent_dim} x layers, at the mean decode context ctx = {context}) / measured copy "
        "bandwidth; compute = flops / measured GEMM peak; bound = the larger. Prefill: flops (formula in "
        "prefill_bound, bench/_gpu_measure.py) / GEMM peak, or all weights once / bandwidth if larger.",
        "fp8_note": "decode_fp8 / prefill_fp8 are ours_fp8's bounds: the same formulas over the FP8 model's weight "
        "bytes (fp8.params; weight_bytes in bench/_gpu_measure.py). A weight matched by FP8_WEIGHTS (q_proj, "
        "q_a_proj, q_b_proj, kv_a_proj_with_mqa, o_proj, and gate/up/down_proj of the dense MLP, shared and routed "
        "experts) of shape [N, K] holds N x K x 1 byte + ceil(N/128) x ceil(K/128) x 4 bytes (a float32 scale per "
        f"[128, 128] block), but a gate/up pair whose N is not a multiple of 128 holds N x K x {item} (the model "
        "keeps their concatenation dequantized: fp8.dequantized_gate_up); embedding, lm_head, kv_b_proj and norms "
        f"hold N x K x {item} ({dtype_name}), routers x 4 (float32). Weights read per step = other_bytes + "
        f"lm_head_bytes + MoE layers x E(1 - (1 - k/E)^B) x bytes_per_expert + B x hidden x {item} (embedding "
        f"rows). The KV cache stays {dtype_name}; the flops are the same and held against the same measured "
        f"{dtype_name} GEMM peak (FP8 weights are widened before the multiply).",
        "decode": bound,
        "prefill": prefill,
        "decode_fp8": bound_fp8,
        "prefill_fp8": prefill_fp8,
    }
    decode = report["decode"]
    for key, per_batch in decode.items():
        own = bound_fp8 if key == "ours_fp8" else bound
        for b, r in per_batch.items():
            r["fraction_of_bound"] = own[b]["bound_ms"] / r["ms_per_step"]
            r["fraction_of_memory_bound"] = own[b]["memory_bound_ms"] / r["ms_per_step"]
    for key, r in report["prefill"].items():
        own = prefill_fp8 if key == "ours_fp8" else prefill
        r["tokens_per_s"] = r["tokens"] / r["seconds"]
        r["tflop_per_s"] = own["flops"] / r["seconds"] / 1e12
        r["fraction_of_bound"] = own["bound_ms"] / 1e3 / r["seconds"]
    report["comparisons"] = _comparisons(decode, report["prefill"])
    for per_batch in decode.values():
        for r in per_batch.values():
            r.pop("tokens")


def _comparisons(decode: dict, prefill: dict) -> dict:
    comparisons = {
        "speedup_vs_hf": {},
        "batch_invariant_over_default_throughput": {},
        "fp8_over_default_throughput": {},
        "fp8_speedup_vs_hf": {},
        "token_match_vs_hf": {},
        "token_match_batch_invariant_vs_default": {},
        "token_match_fp8_vs_default": {},
    }
    hf, invariant, fp8 = decode.get("hf", {}), decode.get("ours_batch_invariant", {}), decode.get("ours_fp8", {})
    for b, r in decode.get("ours_default", {}).items():
        if b in hf:
            comparisons["speedup_vs_hf"][b] = hf[b]["ms_per_step"] / r["ms_per_step"]
            comparisons["token_match_vs_hf"][b] = token_match(r["tokens"], hf[b]["tokens"])
        if b in invariant:
            comparisons["batch_invariant_over_default_throughput"][b] = invariant[b]["tokens_per_s"] / r["tokens_per_s"]
            comparisons["token_match_batch_invariant_vs_default"][b] = token_match(invariant[b]["tokens"], r["tokens"])
        if b in fp8:
            comparisons["fp8_over_default_throughput"][b] = fp8[b]["tokens_per_s"] / r["tokens_per_s"]
            comparisons["token_match_fp8_vs_default"][b] = token_match(fp8[b]["tokens"], r["tokens"])
            if b in hf:
                comparisons["fp8_speedup_vs_hf"][b] = hf[b]["ms_per_step"] / fp8[b]["ms_per_step"]
    both = "ours_fp8" in prefill and "ours_default" in prefill
    comparisons["fp8_over_default_prefill_throughput"] = (
        prefill["ours_fp8"]["tokens_per_s"] / prefill["ours_default"]["tokens_per_s"] if both else None
    )
    comparisons["note"] = (
        "token_match_*: greedy tokens of the timed runs (same prompts, benchmark dtype); informational. "
        "*_over_default_*: the variant's tok/s over ours_default's (above 1: the variant is faster)"
    )
    return comparisons


def print_table(report: dict) -> None:
    decode, bound, comparisons = report["decode"], report["bound"], report["comparisons"]

    def cell(key: str, b: str, field: str | None, width: int, digits: int) -> str:
        value = decode.get(key, {}).get(b, {}).get(field) if field else comparisons[key].get(b)
        return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"

    print(
        f"\n{'batch':>5} {'bound ms':>9} | {'ours ms':>8} {'tok/s':>8} {'x bound':>7} | {'inv ms':>7} "
        f"{'inv/def':>7} | {'fp8 bnd':>7} {'fp8 ms':>7} {'x bound':>7} {'fp8/def':>7} | {'hf ms':>8} {'tok/s':>7} "
        f"{'x bound':>7} | {'vs hf':>6}"
    )
    for b in map(str, report["workload"]["batches"]):
        print(
            f"{b:>5} {bound['decode'][b]['bound_ms']:>9.2f} | {cell('ours_default', b, 'ms_per_step', 8, 2)} "
            f"{cell('ours_default', b, 'tokens_per_s', 8, 0)} {cell('ours_default', b, 'fraction_of_bound', 7, 2)} | "
            f"{cell('ours_batch_invariant', b, 'ms_per_step', 7, 2)} "
            f"{cell('batch_invariant_over_default_throughput', b, None, 7, 2)} | "
            f"{bound['decode_fp8'][b]['bound_ms']:>7.2f} {cell('ours_fp8', b, 'ms_per_step', 7, 2)} "
            f"{cell('ours_fp8', b, 'fraction_of_bound', 7, 2)} {cell('fp8_over_default_throughput', b, None, 7, 2)} | "
            f"{cell('hf', b, 'ms_per_step', 8, 2)} {cell('hf', b, 'tokens_per_s', 7, 0)} "
            f"{cell('hf', b, 'fraction_of_bound', 7, 2)} | {cell('speedup_vs_hf', b, None, 6, 2)}"
        )
    p, p8 = bound["prefill"], bound["prefill_fp8"]
    print(f"prefill {p['tokens']} tokens, bound {p['bound_ms']:.1f} ms (FP8 weights {p8['bound_ms']:.1f} ms):")
    for key, r in report["prefill"].items():
        print(f"  {key}: {r['tokens_per_s']:.0f} tok/s, {r['tflop_per_s']:.1f} TFLOP/s, {r['fraction_of_bound']:.2f}")
    if report["hf_agreement"]:
        print(f"greedy agreement with transformers (tiny float32): {report['hf_agreement']['hf_agreement']:.3f}")
    if report["fp8_agreement"]:
        print(f"greedy agreement, FP8 weights vs dequantized (tiny): {_fp8_agreement_text(report['fp8_agreement'])}")
    for mode in ("batch_invariant", "fp8"):
        if report[mode]["reason"]:
            print(report[mode]["reason"])


def _fp8_agreement_text(check: dict) -> str:
    if "error" in check:
        return f"failed to run: {check['error']}"
    return f"{check['fp8_agreement']:.3f}" + ("" if check["exact_expected"] else " (different kernels: informational)")


def write_plot(path, decode: dict, bound: dict, title: str, bound_fp8: dict | None = None) -> dict:
    """ms per decode step against batch for each system and the memory bound(s) (log-log); PNG via Agg."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {"written": False, "reason": "matplotlib is not installed"}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = {
        "ours_default": "DeepInfer",
        "ours_batch_invariant": "DeepInfer, batch-invariant",
        "ours_fp8": "DeepInfer, FP8 weights",
        "hf": "transformers",
    }
    for name, label in labels.items():
        points = sorted((int(b), r["ms_per_step"]) for b, r in decode.get(name, {}).items())
        if points:
            ax.plot(*zip(*points), marker="o", label=label)
    bound_points = sorted((int(b), v["memory_bound_ms"]) for b, v in bound.items())
    ax.plot(*zip(*bound_points), "k--", label="memory bound (weights + KV read / measured copy bandwidth)")
    if bound_fp8 is not None and decode.get("ours_fp8"):
        fp8_points = sorted((int(b), v["memory_bound_ms"]) for b, v in bound_fp8.items())
        ax.plot(*zip(*fp8_points), "k:", label="memory bound, FP8 weights")
    ax.set(xscale="log", yscale="log", xlabel="batch (sequences)", ylabel="ms per decode step", title=title)
    ax.set_xticks([b for b, _ in bound_points], [str(b) for b, _ in bound_points])
    ax.minorticks_off()
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return {"written": True, "path": str(path)}
