"""Adaptive vs fixed verification (issue #17), SIMULATED: DeepInfer's planner (engine/speculative.py
plan_verification) against verifying a fixed k drafts, with a stated acceptance model and a measured step-cost
curve, at 16-96 sequences. Nothing here runs a model: it shows what the planner would choose and gain if a
drafter's confidences were as assumed, before a GPU run with a real drafter measures it.

    python bench/spec_planner_sim.py                  # cost curve: bench/results/gpu_decode_v41_nvidia_h200.json
    python bench/spec_planner_sim.py --cost-report R --out bench/results/spec_planner_sim_h200_cost.json

Acceptance (simulated): each request, each step, draws a difficulty u ~ U(0, 1); draft j (1-based) is kept,
given drafts 1..j-1 were, with probability c_j = clip(base_j + spread (0.5 - u), 0.02, 0.98). The planner sees
the c_j themselves (an oracle-calibrated confidence, as DSpark's confidence head is trained to be); survival
s_j = c_1 ... c_j. Step cost (measured): the report's default-mode decode ms/step at batch b, taken as the cost
of a step of b tokens, linear between measured batches and past the last: an approximation of a verify step,
whose tokens are b sequences x (1 + drafts).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, versions  # noqa: E402

from deepinfer_core.engine.speculative import plan_verification  # noqa: E402

BASE = (0.9, 0.82, 0.74, 0.66, 0.58)  # conditional acceptance by draft position, for a request of median difficulty


def cost_curve(report: dict) -> list[tuple[int, float]]:
    """(tokens, seconds) points: the report's default-mode decode steps."""
    decode = report["decode"]["ours_default"]
    return sorted((int(batch), result["ms_per_step"] / 1e3) for batch, result in decode.items())


def interpolate(points: list[tuple[int, float]], tokens: int) -> float:
    """Linear between the points, and along the last (first) segment past them."""
    if len(points) == 1:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if tokens <= x1 or (x1, y1) == points[-1]:
            return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
    raise AssertionError("unreachable")


def acceptances(rng: random.Random, k: int, spread: float) -> list[float]:
    u = rng.random()
    return [min(0.98, max(0.02, BASE[min(j, len(BASE) - 1)] + spread * (0.5 - u))) for j in range(k)]


def simulate(batch: int, k: int, steps: int, spread: float, cost, seed: int) -> dict:
    """Tokens/s of fixed-k and of adaptive verification over the same drawn acceptances."""
    rng = random.Random(seed)
    totals = {mode: {"tokens": 0, "seconds": 0.0, "verified": 0} for mode in ("fixed", "adaptive")}
    for _ in range(steps):
        probs = [acceptances(rng, k, spread) for _ in range(batch)]
        draws = [[rng.random() for _ in range(k)] for _ in range(batch)]  # one set of coins for both modes
        survival = []
        for p in probs:
            alive, curve = 1.0, []
            for c in p:
                alive *= c
                curve.append(alive)
            survival.append(curve)
        plans = {
            "fixed": [k] * batch,
            "adaptive": plan_verification([k] * batch, survival, lambda t: cost(t), batch),
        }
        for mode, take in plans.items():
            produced = 0
            for p, coins, n in zip(probs, draws, take):
                accepted = 0
                while accepted < n and coins[accepted] < p[accepted]:
                    accepted += 1
                produced += accepted + 1  # the accepted drafts and the token the step samples itself
            t = totals[mode]
            t["tokens"] += produced
            t["seconds"] += cost(batch + sum(take))
            t["verified"] += sum(take)
    out = {}
    for mode, t in totals.items():
        out[mode] = {
            "tokens_per_s": t["tokens"] / t["seconds"],
            "drafts_verified_per_request_step": t["verified"] / (steps * batch),
            "tokens_per_request_step": t["tokens"] / (steps * batch),
        }
    out["adaptive_gain"] = out["adaptive"]["tokens_per_s"] / out["fixed"]["tokens_per_s"] - 1
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    root = Path(__file__).resolve().parent
    parser.add_argument("--cost-report", type=Path, default=root / "results" / "gpu_decode_v41_nvidia_h200.json")
    parser.add_argument("--batches", default="16,32,48,64,80,96")
    parser.add_argument("--k", type=int, default=5, help="drafts per request (DSpark's block: 5)")
    parser.add_argument("--steps", type=int, default=400, help="simulated steps per batch")
    parser.add_argument("--spread", type=float, default=0.6, help="how much difficulty moves acceptance")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=root / "results" / "spec_planner_sim_h200_cost.json")
    parser.add_argument("--plot", type=Path, default=None, help="PNG (default: beside --out)")
    args = parser.parse_args(argv)
    report = json.loads(args.cost_report.read_text())
    points = cost_curve(report)

    def cost(tokens: int) -> float:
        return interpolate(points, tokens)

    rows = {}
    for batch in [int(b) for b in args.batches.split(",")]:
        rows[str(batch)] = simulate(batch, args.k, args.steps, args.spread, cost, args.seed + batch)
        r = rows[str(batch)]
        print(f"batch {batch}: fixed {r['fixed']['tokens_per_s']:.0f} tok/s, adaptive "
              f"{r['adaptive']['tokens_per_s']:.0f} ({100 * r['adaptive_gain']:+.1f}%), drafts verified "
              f"{r['adaptive']['drafts_verified_per_request_step']:.2f} of {args.k}", flush=True)  # fmt: skip
    result = {
        "benchmark": "spec_planner_sim",
        "simulated": "acceptance is SIMULATED (see method); the step-cost curve is the cost report's measurement",
        "command": " ".join(["python", "bench/spec_planner_sim.py", *(argv if argv is not None else sys.argv[1:])]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        "versions": versions(),
        "method": __doc__.split("\n\n", 2)[2].strip(),
        "cost_report": {
            "file": args.cost_report.name,
            "commit": report.get("commit"),
            "device": report.get("machine", {}).get("device", {}).get("gpu_name"),
            "points_tokens_seconds": points,
        },
        "acceptance": {"base_by_position": BASE[: args.k], "spread": args.spread, "k": args.k},
        "steps_per_batch": args.steps,
        "batches": rows,
    }
    result["plot"] = _plot(args.plot or args.out.with_suffix(".png"), rows, args.k)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def _plot(path: Path, rows: dict, k: int) -> dict:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {"written": False, "reason": "matplotlib is not installed"}
    batches = [int(b) for b in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, label in (("fixed", f"verify all {k} drafts"), ("adaptive", "adaptive (plan_verification)")):
        ax.plot(batches, [rows[str(b)][mode]["tokens_per_s"] for b in batches], marker="o", label=label)
    ax.set(xlabel="sequences", ylabel="tokens / s", title="Verification planner, SIMULATED acceptance")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return {"written": True, "file": path.name}


if __name__ == "__main__":
    sys.exit(main())
