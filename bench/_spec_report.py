"""The report of gpu_spec_verify.py: a run's steps summed up as decode throughput, rounds combined, the workload and
the adaptive engine's step-cost table described, the plot."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from statistics import median

from deepinfer_core.engine.engine import Engine, EngineConfig


@dataclass(frozen=True, slots=True)
class Step:
    """One engine.step() call: its seconds, and what the step it reported computed."""

    seconds: float
    prompt_tokens: int  # -1: the call reported no step (asynchronous scheduling's first)
    sequences: int  # requests that got tokens
    tokens: int


def decode_summary(steps: list[Step], batch: int) -> dict:
    """Tokens/s of the decode steps (no prompt tokens): while all `batch` sequences run, and in all."""
    decode = [s for s in steps if s.prompt_tokens == 0 and s.tokens]
    full = [s for s in decode if s.sequences == batch]
    if not full:
        raise RuntimeError(f"no decode step ran all {batch} sequences: {steps}")
    return {
        "tokens_per_s": sum(s.tokens for s in full) / sum(s.seconds for s in full),
        "tokens_per_s_whole": sum(s.tokens for s in decode) / sum(s.seconds for s in decode),
        "ms_per_step": 1e3 * median(s.seconds for s in full),
        "tokens_per_step": sum(s.tokens for s in full) / len(full),
        "full_batch_steps": len(full),
        "decode_steps": len(decode),
        "prefill_ms": 1e3 * sum(s.seconds for s in steps if s.prompt_tokens > 0),
        "step_ms": [round(1e3 * s.seconds, 3) for s in decode],  # in order: a slow stretch shows
    }


def combine(rounds: list[dict]) -> dict:
    """Medians over rounds of each number (None where no round has one); spec_stats summed; the rounds kept."""
    first, out = rounds[0], {}
    for key, value in first.items():
        if value is None or isinstance(value, (int, float)):
            numbers = [r[key] for r in rounds if r[key] is not None]
            out[key] = median(numbers) if numbers else None
    if "spec_stats" in first:
        stats = [r["spec_stats"] for r in rounds]
        total = {key: sum(s[key] for s in stats) for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        total["accepted_per_position"] = [sum(p) for p in zip(*(s["accepted_per_position"] for s in stats))]
        total["mean_accepted_length"] = 1 + total["num_accepted_tokens"] / max(total["num_drafts"], 1)
        out["spec_stats"] = total
        out["plain_match_fraction"] = min(r["plain_match"]["identical_token_fraction"] for r in rounds)
    else:
        out["drafts_verified_per_request_step"], out["tokens_per_request_step"] = 0.0, 1.0
    out["rounds"] = rounds
    return out


def workload(args, config: EngineConfig) -> dict:
    return {
        "batches": args.batches,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "warmup_tokens": args.warmup_tokens,
        "repeats": args.repeats,
        "k": args.k,
        "oracle_horizon": args.oracle_horizon,
        "seed": args.seed,
        "greedy": True,
        "ignore_eos": True,
        "prompts": "uniform random ids in [8, vocab), fresh each round; the same prompts for the three modes",
        "engine": {
            "num_kv_blocks": config.num_kv_blocks,
            "max_num_seqs": config.scheduler.max_num_seqs,
            "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
            "step_budget_s": config.scheduler.step_budget_s,
            "graph_batch_size": config.graph_batch_size,
            "speculative": "ngram's config with verify fixed / adaptive and its proposer replaced by ProfileDrafts",
        },
    }


def step_costs(engine: Engine) -> dict:
    """The step-cost tables the adaptive engine profiled at start-up (engine/step_costs.py), if it has them: verify
    steps of k + 1 tokens a sequence, decode steps and, where verify steps replay graphs, padded steps by depth d."""
    scheduler = engine.scheduler
    table = getattr(scheduler, "step_costs", None)
    if table is None:
        return {"profiled": False, "reason": "the adaptive engine's scheduler has no step_costs table"}

    def points(table) -> dict:
        return {"tokens": list(table.tokens), "ms": [1e3 * s for s in table.seconds]}

    report = {"profiled": True, **points(table)}
    if scheduler.decode_costs is not None:
        report["decode"] = points(scheduler.decode_costs)
    padded = getattr(scheduler, "padded_costs", ())
    report["padded_verify_batch"] = getattr(scheduler, "padded_verify_batch", 0)
    report["padded_by_depth"] = {str(d): points(t) for d, t in enumerate(padded, start=1)}
    return report


def git_head() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
    except OSError:
        return None
    return done.stdout.strip() or None


def plot(path: Path, batches: dict, k: int, title: str) -> dict:
    """Decode tokens/s against sequences for each mode; beside it, drafts verified per request-step."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {"written": False, "reason": "matplotlib is not installed"}
    xs = [int(b) for b in batches]
    labels = {"plain": "plain decoding", "fixed": f"verify all {k} drafts", "adaptive": "adaptive verification",
              "fixed_sync": f"verify all {k} drafts, scheduled synchronously"}  # fmt: skip
    labels = {mode: label for mode, label in labels.items() if mode in batches[str(xs[0])]}
    fig, (rate, verified) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (mode, label), color in zip(labels.items(), ("C0", "C1", "C2", "C3")):
        rate.plot(xs, [batches[str(b)][mode]["tokens_per_s"] for b in xs], marker="o", color=color, label=label)
        if mode != "plain":
            ys = [batches[str(b)][mode]["drafts_verified_per_request_step"] for b in xs]
            verified.plot(xs, ys, marker="o", color=color, label=f"{label}: drafts verified")
            ys = [batches[str(b)][mode]["tokens_per_request_step"] for b in xs]
            verified.plot(xs, ys, marker="x", color=color, linestyle="--", label=f"{label}: tokens yielded")
    rate.set(xlabel="sequences", ylabel="decode tokens / s", title="throughput (SIMULATED acceptance)")
    verified.set(xlabel="sequences", ylabel="per request-step", title=f"drafts verified (of {k}) and tokens yielded")
    verified.set_ylim(0, k + 0.5)
    for ax in (rate, verified):
        ax.set_xticks(xs)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return {"written": True, "file": path.name}
