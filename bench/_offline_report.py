"""The report of offline_throughput.py: per-system results, distance from the bound, greedy agreement, the table."""

from __future__ import annotations

from _common import median


def system_result(info: dict, seconds: list[float], tokens: list[list[int]], extras: list[dict], repeats: int) -> dict:
    """One system's entry of "results": its info, times over the repeats, throughput and extra counters.

    An extra counter is one value where every repeat agrees, else the list of them.
    """
    generated = sum(len(t) for t in tokens) // repeats
    result = dict(info)
    result["seconds_per_repeat"] = seconds
    result["median_seconds"] = median(seconds)
    result["best_seconds"] = min(seconds)
    result["total_seconds"] = result["median_seconds"]
    result["output_tokens"] = generated
    result["output_tokens_per_s"] = generated / result["median_seconds"]
    result["output_tokens_per_s_best"] = generated / result["best_seconds"]
    for key in extras[0]:
        values = [e[key] for e in extras]
        result[key] = values[0] if all(v == values[0] for v in values) else values
    return result


def add_comparisons(results: list[dict], bound_info: dict, hf_batched: dict | None) -> None:
    """Add each result's fraction of the bound and, where Hugging Face ran batched, its speedup over it."""
    lower = bound_info["lower_bound_seconds_estimate"]
    for r in results:
        r["fraction_of_bound_estimate"] = lower / r["median_seconds"]
        r["fraction_of_memory_bound_estimate"] = bound_info["memory_bound_seconds_estimate"] / r["median_seconds"]
    if hf_batched is not None:
        for r in results:
            r["speedup_vs_hf_batched"] = hf_batched["median_seconds"] / r["median_seconds"]


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How far two systems' greedy outputs for the same prompts agree, by prompt and by position."""
    same = [x == y for x, y in zip(a, b)]

    def first_diff(x, y):
        return next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))

    token_matches = sum(p == q for x, y in zip(a, b) for p, q in zip(x, y))
    total = sum(max(len(x), len(y)) for x, y in zip(a, b))
    return {
        "identical_prompt_fraction": sum(same) / len(same),
        "identical_prompts": sum(same),
        "prompts": len(same),
        "position_match_fraction": token_matches / total if total else 1.0,
        "first_divergence_index": [None if s else first_diff(x, y) for s, x, y in zip(same, a, b)],
    }


def greedy_agreement(tokens: dict[str, list[list[int]]]) -> dict:
    """DeepInfer against every other system, and Hugging Face batched against batch 1 where both ran."""
    agree = {}
    names = list(tokens)
    for other in names[1:]:
        agree[f"deepinfer_vs_{other}"] = agreement(tokens["deepinfer"], tokens[other])
    if "hf_batch1" in tokens and len(names) > 2:
        agree[f"{names[1]}_vs_hf_batch1"] = agreement(tokens[names[1]], tokens["hf_batch1"])
    return agree


def print_table(results: list[dict], bound_info: dict, agree: dict) -> None:
    lower = bound_info["lower_bound_seconds_estimate"]
    print()
    print(f"{'system':<14} {'median s':>9} {'best s':>8} {'out tok/s':>10} {'steps':>6} {'x bound':>8} {'vs HF':>6}")
    for r in results:
        steps = r.get("engine_steps", r.get("forward_steps"))
        speedup = r.get("speedup_vs_hf_batched")
        print(
            f"{r['system']:<14} {r['median_seconds']:>9.3f} {r['best_seconds']:>8.3f} "
            f"{r['output_tokens_per_s']:>10.1f} {steps if steps is not None else '-':>6} "
            f"{r['median_seconds'] / lower:>8.1f} {f'{speedup:.2f}x' if speedup else '-':>6}"
        )
    print(
        f"{'bound (est.)':<14} {lower:>9.3f} {'':>8} {bound_info['bound_output_tokens_per_s_estimate']:>10.1f} "
        f"{bound_info['min_forward_steps']:>6}   (memory {bound_info['memory_bound_seconds_estimate']:.3f} s, "
        f"compute {bound_info['compute_bound_seconds_estimate']:.3f} s)"
    )
    for pair, a in agree.items():
        print(
            f"greedy agreement {pair}: {a['identical_prompts']}/{a['prompts']} prompts identical, "
            f"{a['position_match_fraction']:.3f} of positions"
        )
