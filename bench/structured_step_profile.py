"""Where a structured-output decode step's time goes (issue #19): the same batch decoded unconstrained and with
every request constrained, each run three ways in one process: timed alone; under torch.profiler (the device's
busy time from its kernels against the wall time: a step bound by the host leaves the device idle); and under
cProfile (the host's time per engine function, per step).

    python bench/structured_step_profile.py --accelerator nvidia --model v4-width \
        --out bench/results/structured_step_profile_v4_width_nvidia_h200.json

--model as bench/structured_overhead.py. cProfile slows the host's Python several times over: its per-function
times rank the host's work; the plain timed run is the one to read throughput from.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_report  # noqa: E402
from structured_overhead import CONSTRAINTS, workload, write_v4_width  # noqa: E402

# the engine's functions whose cumulative time is reported (name as cProfile's function, module path fragment)
WATCHED = (
    ("step", "engine/engine.py"),
    ("_launch", "engine/engine.py"),
    ("_finalize", "engine/engine.py"),
    ("execute", "engine/runner.py"),
    ("prepare", "engine/runner.py"),
    ("run_model", "engine/runner.py"),
    ("sample", "engine/runner.py"),
    ("advance_grammars", "engine/pending.py"),
    ("_read", "engine/pending.py"),
    ("wait", "engine/transfer.py"),
    ("apply_grammars", "structured/masks.py"),
    ("fill", "structured/grammars.py"),
    ("accept", "structured/grammars.py"),
    ("schedule", "engine/scheduler.py"),
    ("_append_token", "engine/engine.py"),
    ("_detokenize", "engine/engine.py"),
    ("build", "sampling/"),
)


def device_busy(llm, prompts, params) -> dict:
    """Wall time of one run under torch.profiler and the summed time of the device's kernels and copies."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
    device_us = sum(e.device_time for e in prof.events() if e.device_type.name == "CUDA")
    return {"wall_s": wall, "device_busy_s": device_us / 1e6, "device_busy_fraction": device_us / 1e6 / wall}


def host_profile(llm, prompts, params, steps: int) -> dict:
    """cProfile of one run: the watched functions' cumulative time per step, and the top functions by own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    llm.generate(prompts, params, use_tqdm=False)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, tottime, cumtime, ..)
    watched = {}
    for (file, _, name), (_, calls, _, cumtime, _) in stats.items():
        for want, where in WATCHED:
            if name == want and where in file:
                key = f"{where.rstrip('/').split('/')[-1]}:{name}"
                entry = watched.setdefault(key, {"calls": 0, "ms_per_step": 0.0})
                entry["calls"] += calls
                entry["ms_per_step"] += cumtime * 1e3 / steps
    top = sorted(stats.items(), key=lambda item: -item[1][2])[:25]
    return {
        "cumulative_ms_per_step": watched,
        "top_own_time_ms_per_step": [
            {"function": f"{Path(file).name}:{line}({name})", "calls": calls, "ms_per_step": tottime * 1e3 / steps}
            for (file, line, name), (_, calls, tottime, _, _) in top
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", choices=("demo", "v4-width"), default="demo")
    parser.add_argument("--layers", type=int, default=4, help="--model v4-width's layer count")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    from deepinfer import LLM

    scratch = tempfile.TemporaryDirectory(prefix="structured_profile_")
    if args.model == "demo":
        llm = LLM(accelerator=args.accelerator, max_num_seqs=args.batch, progress=False)
    else:
        folder = write_v4_width(Path(scratch.name), "cuda" if args.accelerator != "cpu" else "cpu", args.layers)
        llm = LLM(str(folder), accelerator=args.accelerator, dtype="bfloat16", max_num_seqs=args.batch, progress=False)
    rows = []
    for name, constraint in [("unconstrained", None), *CONSTRAINTS.items()]:
        prompts, params = workload(args.batch, args.max_tokens, constraint)
        llm.generate(prompts, params, use_tqdm=False)  # warm: graphs, grammar, caches
        times = []
        for _ in range(3):
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
        steps = args.max_tokens  # one prefill step and max_tokens - 1 decodes, all in one step each
        row = {"constraint": name, "seconds": sorted(times)[1], "ms_per_step": sorted(times)[1] * 1e3 / steps}
        row["torch_profiler"] = device_busy(llm, prompts, params)
        row["cprofile"] = host_profile(llm, prompts, params, steps)
        rows.append(row)
        busy = row["torch_profiler"]["device_busy_fraction"]
        print(f"{name}: {row['ms_per_step']:.2f} ms a step, device busy {busy:.0%} under torch.profiler", flush=True)
    write_report(
        args.out,
        "structured_step_profile",
        argv,
        {
            "backend": llm.backend.info.name,
            "device": llm.backend.device.name,
            "model": args.model,
            "layers": args.layers if args.model == "v4-width" else None,
            "batch": args.batch,
            "max_tokens": args.max_tokens,
            "constraints": CONSTRAINTS,
            "method": "per constraint: a warm-up run, the median of 3 timed runs (ms_per_step = run / max_tokens), one "
            "run under torch.profiler (device busy = summed device event time / wall), one under cProfile "
            "(cumulative ms per step of the engine's functions; top functions by own time)",
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
