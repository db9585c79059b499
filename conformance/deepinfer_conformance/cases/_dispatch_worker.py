"""Expert dispatch/combine for test_dispatch.py: scenarios, expert functions, and the gloo worker.

A worker is one rank of a real torch.distributed world on CPU. It is started as a plain subprocess,
    python _dispatch_worker.py RANK WORLD_SIZE RENDEZVOUS_FILE INPUTS_FILE OUT_DIR
joins the gloo group through a file:// rendezvous, discovers the installed backends, resolves the one
under test for (world_size, rank), and runs dispatch -> expert function -> combine for every scenario
on its own tokens. Results go to OUT_DIR/rank{RANK}.pt; any error is written there too, with its
traceback. The file is loaded by path (by the test and as a script), so it needs no package imports
of its own beyond torch and deepinfer_core.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

GLOO_TIMEOUT_S = 20.0  # one collective inside a worker; the test's whole-world limit is separate
NUM_EXPERTS = 8


# ---------------------------------------------------------------------------------------------
# Expert functions: applied to the dispatched rows of each rank, and by the in-process reference
# ---------------------------------------------------------------------------------------------


def row_expert_ids(tokens_per_expert: torch.Tensor, first_expert: int) -> torch.Tensor:
    """Global expert id of every dispatched row (rows are grouped by local expert, in order)."""
    local = torch.arange(tokens_per_expert.numel(), dtype=torch.int64, device=tokens_per_expert.device)
    return torch.repeat_interleave(local + first_expert, tokens_per_expert)


def elementwise_expert(rows: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """rows * (g + 1) + g: elementwise, so every placement of the rows gives the same bits."""
    g = expert_ids.to(rows.dtype)[:, None]
    return rows * (g + 1) + g


def linear_expert(rows: torch.Tensor, expert_ids: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor):
    """A per-expert linear layer: rows of expert g -> rows @ weight[g].T + bias[g]."""
    weight, bias = weight.to(rows.device), bias.to(rows.device)
    out = torch.zeros_like(rows)
    for g in expert_ids.unique().tolist():
        mask = expert_ids == g
        out[mask] = rows[mask] @ weight[g].T + bias[g]
    return out


def run_scenario(comm, scenario: dict, inp: dict, rank: int, world_size: int, device="cpu") -> dict:
    """dispatch -> both expert functions -> combine on one rank; results on CPU."""
    num_experts = scenario["num_experts"]
    hidden, topk_ids, topk_weights = (inp[k].to(device) for k in ("hidden", "topk_ids", "topk_weights"))
    d = comm.dispatch(hidden, topk_ids, num_experts)
    ids = row_expert_ids(d.tokens_per_expert.to(torch.int64), rank * (num_experts // world_size))
    elementwise = comm.combine(elementwise_expert(d.hidden, ids), d, topk_weights)
    linear = comm.combine(linear_expert(d.hidden, ids, scenario["weight"], scenario["bias"]), d, topk_weights)
    return {
        "rows": d.hidden.cpu(),
        "tokens_per_expert": d.tokens_per_expert.cpu(),
        "elementwise": elementwise.cpu(),
        "linear": linear.cpu(),
    }


# ---------------------------------------------------------------------------------------------
# Scenarios: every rank has its own tokens (counts differ), random top-k over 8 experts
# ---------------------------------------------------------------------------------------------


def _make(
    seed: int,
    token_counts: list[int],
    top_k: int,
    unused: tuple[int, ...] = (),
    dtype: torch.dtype = torch.float32,
    dim: int = 16,
) -> dict:
    gen = torch.Generator().manual_seed(seed)
    experts = torch.tensor([e for e in range(NUM_EXPERTS) if e not in unused], dtype=torch.int64)
    inputs, tag = [], 0
    for tokens in token_counts:
        hidden = torch.randn(tokens, dim, generator=gen)
        hidden[:, 0] = torch.arange(tag, tag + tokens, dtype=torch.float32)  # a tag that traces a row to its token
        pick = torch.rand(tokens, len(experts), generator=gen).argsort(dim=1)[:, :top_k]  # distinct experts
        weights = torch.rand(tokens, top_k, generator=gen) + 0.1
        inputs.append({"hidden": hidden.to(dtype), "topk_ids": experts[pick], "topk_weights": weights})
        tag += tokens
    weight = torch.randn(NUM_EXPERTS, dim, dim, generator=gen) / dim**0.5
    bias = torch.randn(NUM_EXPERTS, dim, generator=gen)
    return {
        "num_experts": NUM_EXPERTS,
        "top_k": top_k,
        "unused_experts": list(unused),
        "dtype": dtype,
        "inputs": inputs,
        "weight": weight.to(dtype),
        "bias": bias.to(dtype),
    }


def scenarios(world_size: int) -> dict[str, dict]:
    """The same scenario names for every world size, run in this order. With 8 experts, rank r of W owns
    experts [r*8/W, (r+1)*8/W)."""
    counts = {
        1: [[9], [23], [37], [0], [11]],
        2: [[5, 9], [17, 3], [40, 25], [0, 7], [6, 4]],
        4: [[4, 5, 6, 7], [9, 2, 5, 1], [30, 11, 1, 20], [3, 0, 11, 6], [2, 5, 3, 4]],
    }[world_size]
    base = 100 * world_size
    return {
        "top1": _make(base + 1, counts[0], 1),
        "top2": _make(base + 2, counts[1], 2),
        "top3_unused_experts": _make(base + 3, counts[2], 3, unused=(0, 5)),  # experts of rank 0 and of another
        # one rank sends nothing (with world size 1: an empty batch); experts 6 and 7 receive nothing,
        # so with world size 4 rank 3 receives nothing either
        "rank_without_tokens": _make(base + 4, counts[3], 2, unused=(6, 7)),
        "bfloat16": _make(base + 5, counts[4], 2, dtype=torch.bfloat16),
    }


# ---------------------------------------------------------------------------------------------
# Worker
# ---------------------------------------------------------------------------------------------


def worker_main(argv: list[str]) -> None:
    import torch.distributed as dist

    rank, world_size = int(argv[0]), int(argv[1])
    init_file, in_path, out_dir = Path(argv[2]), Path(argv[3]), Path(argv[4])
    started = time.monotonic()

    def log(message: str) -> None:  # progress, for the log the test shows when a world fails or hangs
        print(f"[rank {rank}/{world_size} +{time.monotonic() - started:.2f}s] {message}", flush=True)

    torch.set_num_threads(1)
    results: dict = {}
    try:
        spec = torch.load(in_path, weights_only=False)
        log("joining the gloo group")
        dist.init_process_group(
            "gloo",
            init_method=init_file.as_uri(),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=GLOO_TIMEOUT_S),
        )
        log("joined")
        from deepinfer_core.backend.registry import discover
        from deepinfer_core.backend.resolve import resolve_backend
        from deepinfer_core.backend.selection import select_backend

        entry = select_backend(discover(), spec["backend"])
        resolved = resolve_backend(entry, dtype=spec["dtype"], world_size=world_size, rank=rank)
        comm = resolved.communicator
        log(f"resolved backend {entry.name}: {type(comm).__name__}")
        results["communicator"] = type(comm).__name__
        results["rank"], results["world_size"] = comm.rank, comm.world_size
        for name, scenario in spec["scenarios"].items():
            try:
                log(f"scenario {name} ...")
                results[name] = run_scenario(comm, scenario, scenario["inputs"][rank], rank, world_size)
                log(f"scenario {name} done")
            except Exception:  # noqa: BLE001 - reported per scenario; later collectives would not line up
                results[name] = {"error": traceback.format_exc()}
                log(f"scenario {name} failed: {results[name]['error'].strip().splitlines()[-1]}")
                return  # peers see the connection close (or the gloo timeout) and stop too
        try:
            dist.barrier()
            dist.destroy_process_group()
            log("left the group")
        except Exception:  # noqa: BLE001 - e.g. a peer that failed its last scenario already left
            results["teardown"] = traceback.format_exc()
    except Exception:  # noqa: BLE001
        results["fatal"] = traceback.format_exc()
        log(f"failed: {results['fatal']}")
    finally:
        tmp = out_dir / f"rank{rank}.pt.tmp"
        torch.save(results, tmp)
        tmp.rename(out_dir / f"rank{rank}.pt")
        if dist.is_initialized():
            # left early with a live gloo group: a normal interpreter exit could hang or abort in its threads
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


if __name__ == "__main__":
    worker_main(sys.argv[1:])
