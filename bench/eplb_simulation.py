"""EPLB simulated at DeepSeek's scales (issue #20): 64 and 128 ranks, V4 Flash's 256 and V4.1 Flash's 384 routed
experts over 43 / 40 MoE layers, the seeds' prefill and decode settings; the moe_lb ratio (busiest rank's expert
load over the mean rank's, per layer and step, averaged) of the contiguous placement and of EPLB's, in one run.

    python bench/eplb_simulation.py --out bench/results/eplb_simulation.json

The loads are SYNTHETIC, not recorded from a served model (no real V4 / V4.1 weights run here): per layer, each
expert's popularity is log-normal (sigma --skew), drifting as a random walk in log space between windows
(--drift); a step's token count per expert is Poisson around popularity x the step's routed tokens. EPLB places
from the counts of one window and is measured on the next, as a running engine rebalances on the past and serves
the future. DeepSeek's published ratios (prefill 1.045-1.074, decode 1.090; real traffic) stand beside ours.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import machine, versions  # noqa: E402

from deepinfer_core.parallel.eplb import balance_ratio, contiguous, rebalance  # noqa: E402

MODELS = {"v4_flash": (256, 43), "v41_flash": (384, 40)}  # routed experts, MoE layers
TOP_K = 6
# the seeds' settings: redundant copies per rank, window of steps, routed tokens per rank and step
PHASES = {
    "prefill": {"redundant_per_rank": 4, "window": 100, "tokens_per_rank": 4096, "ranks_per_node": 8},
    "decode": {"redundant_per_rank": 1, "window": 1000, "tokens_per_rank": 128, "ranks_per_node": 8},
}
PUBLISHED = {"prefill": [1.045, 1.074], "decode": [1.090]}


def physical_slots(experts: int, ranks: int, redundant_per_rank: int) -> int:
    """experts + redundant copies, rounded up to whole ranks (decode: 1 per rank before rounding)."""
    wanted = experts + redundant_per_rank * ranks
    return -(-wanted // ranks) * ranks


def window_loads(popularity: torch.Tensor, steps: int, tokens: int, generator: torch.Generator) -> torch.Tensor:
    """[steps, L, E] Poisson token counts around popularity [L, E] (rows sum to 1) x tokens x top-k."""
    rate = (popularity * tokens * TOP_K).expand(steps, *popularity.shape)
    return torch.poisson(rate, generator=generator)


def mean_ratio(placement, loads: torch.Tensor, ranks: int) -> float:
    """The moe_lb ratio averaged over the steps and layers of loads [S, L, E]."""
    per_step = [balance_ratio(placement.rank_loads(step, ranks)) for step in loads]
    return float(torch.stack(per_step).mean())


def simulate(model: str, phase: str, ranks: int, skew: float, drift: float, eval_steps: int, seed: int) -> dict:
    experts, layers = MODELS[model]
    settings = PHASES[phase]
    generator = torch.Generator().manual_seed(seed)
    log_popularity = torch.randn((layers, experts), generator=generator) * skew
    tokens = settings["tokens_per_rank"] * ranks
    past = window_loads(torch.softmax(log_popularity, dim=1), settings["window"], tokens, generator)
    log_popularity = log_popularity + torch.randn((layers, experts), generator=generator) * drift
    future = window_loads(torch.softmax(log_popularity, dim=1), eval_steps, tokens, generator)
    slots = physical_slots(experts, ranks, settings["redundant_per_rank"])
    nodes = max(1, ranks // settings["ranks_per_node"])
    started = time.perf_counter()
    placement = rebalance(past.sum(dim=0), slots, num_groups=1, num_nodes=nodes, num_ranks=ranks)
    seconds = time.perf_counter() - started
    return {
        "model": model,
        "phase": phase,
        "ranks": ranks,
        "experts": experts,
        "moe_layers": layers,
        "physical_slots": slots,
        "routed_tokens_per_step": tokens,
        "window_steps": settings["window"],
        "eval_steps": eval_steps,
        "moe_lb_contiguous": mean_ratio(contiguous(layers, experts, ranks), future, ranks),
        "moe_lb_eplb": mean_ratio(placement, future, ranks),
        "moe_lb_eplb_on_its_own_window": mean_ratio(placement, past[:eval_steps], ranks),
        "rebalance_seconds": seconds,
    }


def plot(rows: list[dict], path: Path) -> dict:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {"written": False, "reason": "matplotlib is not installed"}
    figure, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for axis, phase in zip(axes, PHASES):
        picked = [r for r in rows if r["phase"] == phase]
        labels = [f"{r['model']}\n{r['ranks']} ranks" for r in picked]
        x = torch.arange(len(picked)).tolist()
        axis.bar([i - 0.2 for i in x], [r["moe_lb_contiguous"] for r in picked], 0.4, label="contiguous")
        axis.bar([i + 0.2 for i in x], [r["moe_lb_eplb"] for r in picked], 0.4, label="EPLB (previous window)")
        for value in PUBLISHED[phase]:
            axis.axhline(value, color="gray", linestyle="--", linewidth=1)
        axis.set_xticks(x, labels, fontsize=8)
        axis.set_title(f"{phase} (dashed: DeepSeek's published ratios)")
        axis.set_ylabel("moe_lb ratio (busiest rank / mean)")
        axis.legend()
    figure.suptitle("EPLB on synthetic skewed loads")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return {"written": True, "path": str(path)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="64,128")
    parser.add_argument("--skew", type=float, default=1.0, help="sigma of the log-normal expert popularity")
    parser.add_argument("--drift", type=float, default=0.1, help="sigma of the log-popularity drift per window")
    parser.add_argument("--eval-steps", type=int, default=20, help="steps of the next window measured")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    rows = []
    for phase in PHASES:
        for model in MODELS:
            for ranks in [int(r) for r in args.ranks.split(",")]:
                row = simulate(model, phase, ranks, args.skew, args.drift, args.eval_steps, args.seed)
                rows.append(row)
                print(
                    f"{phase} {model} {ranks} ranks: moe_lb {row['moe_lb_contiguous']:.3f} contiguous -> "
                    f"{row['moe_lb_eplb']:.3f} EPLB ({row['physical_slots']} slots, rebalance "
                    f"{row['rebalance_seconds']:.2f} s)",
                    flush=True,
                )
    out = Path(args.out)
    report = {
        "benchmark": "eplb_simulation",
        "command": " ".join(["python", "bench/eplb_simulation.py", *(argv if argv is not None else sys.argv[1:])]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        "versions": versions(),
        "loads": f"SYNTHETIC: log-normal popularity (sigma {args.skew}) per layer, log-space drift sigma "
        f"{args.drift} between the window EPLB sees and the one measured, Poisson counts per step; top-{TOP_K}",
        "policy": "global (V4 / V4.1 route without expert groups); nodes of 8 ranks",
        "phases": PHASES,
        "published_deepseek": PUBLISHED,
        "rows": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    report["plot"] = plot(rows, out.with_suffix(".png"))
    out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
