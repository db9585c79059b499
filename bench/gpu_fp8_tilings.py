"""The default mode's FP8 projection tilings, swept per V4 Flash shape and row count on one GPU (issue #18):
kernels/gemm.batched_matmul with V4's FP8 weights (128 x 128 blocks, E8M0 scales) in every tiling of a small grid,
against cuBLAS on the same values in bf16, so that `gemm.quantized_tiling`'s table can be read off the result.

    python bench/gpu_fp8_tilings.py --out bench/results/gpu_fp8_tilings_nvidia_h200.json   # on the H200, ~1 min
    python bench/gpu_fp8_tilings.py --rows 1,16,32,64 --out bench/results/gpu_fp8_tilings_small_nvidia_h200.json
    python bench/gpu_fp8_tilings.py --table bench/results/gpu_fp8_tilings_nvidia_h200.json \
        bench/results/gpu_fp8_tilings_small_nvidia_h200.json --write  # the table

Every timing reads its weight from HBM, as a model's step reads its layers' (each call of a replay on the next
of enough copies of the weight to span 4 x L2), not from L2 as a loop over one weight would. The kernels are
compiled first by --jobs processes at once (Triton's on-disk cache), then timed by this one
alone (median of 7 timings of 20 calls replayed as one CUDA graph). --tiny: small shapes under Triton's
interpreter (a CPU smoke run; its times mean nothing).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

if "--tiny" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, versions  # noqa: E402
from _gpu_measure import device_info, replayed_ms  # noqa: E402
from gpu_quant_kernels import PROJECTIONS, copies, rotating  # noqa: E402

from deepinfer_core.backend.weight_formats import BlockFP8  # noqa: E402
from deepinfer_nvidia_sm100.kernels import gemm  # noqa: E402


def tilings(rows: int, tiny: bool) -> list[tuple[tuple[int, int, int, int], int, int]]:
    """((BM, BN, BK, warps), waves, stages) to try at `rows`: 16-row tiles up to 16 rows, 32 / 64 up to 64, 64 /
    128 above (128 x 128 x 64, 8 warps, 3 stages among them: the default mode's tiling from 128 rows before).
    Up to 64 rows also 32-column tiles (more programs, fewer K splits: a GEMV-like call's bytes in flight)."""
    if tiny:
        return [((16, 32, 32, 4), 1, 1), ((16, 32, 64, 4), 2, 1)]
    if rows <= gemm.SMALL_ROWS:
        grid = itertools.product((16,), (32, 64, 128), (128, 256), (2, 4), (1, 2, 4), (3, 4, 5))
    elif rows <= 64:
        grid = itertools.product((32, 64), (32, 64, 128), (64, 128), (4, 8), (1, 2, 4), (3, 4))
    else:
        grid = itertools.product((64, 128), (64, 128), (64, 128), (4, 8), (1, 2), (3, 4))
    return [((bm, bn, bk, warps), waves, stages) for bm, bn, bk, warps, waves, stages in grid]


INNER = 20  # calls in one replayed graph
MODULE = Path(__file__).resolve().parents[1] / "backends/nvidia_sm100/deepinfer_nvidia_sm100/kernels/fp8_tilings.py"
TABLE_START, TABLE_END = "# --- the table (bench/gpu_fp8_tilings.py --table) ---", "# --- end of the table ---"
NAME = r"bm(\d+)_bn(\d+)_bk(\d+)_w(\d+)_waves(\d+)_s(\d+)"  # `name`'s pattern


def name(spec: tuple[tuple[int, int, int, int], int, int]) -> str:
    (bm, bn, bk, warps), waves, stages = spec
    return f"bm{bm}_bn{bn}_bk{bk}_w{warps}_waves{waves}_s{stages}"


def cases(args, device: torch.device):
    """(shape name, n, k, copies of the FP8 weight, copies of its bf16 twin) for the chosen shapes: enough copies
    that a replay's calls, each on the next copy, read the weight from HBM as a model's step does (not from L2)."""
    g = torch.Generator(device=device).manual_seed(1)
    for shape, n, k in PROJECTIONS["tiny" if args.tiny else "full"]:
        if args.shapes and shape not in args.shapes:
            continue
        fp8 = BlockFP8.quantize(torch.randn(n, k, generator=g, device=device) * k**-0.5, (128, 128), "e8m0")
        dense = fp8.dequantize().to(args.dtype)
        yield shape, n, k, copies(fp8, INNER), copies(dense, INNER)


def compile_part(args, device: torch.device, part: int, parts: int) -> None:
    """Run every `part`-th (shape, rows, tiling) once: fills Triton's cache for the timing process."""
    jobs = [(c, m, spec) for c in cases(args, device) for m in args.row_list for spec in tilings(m, args.tiny)]
    for (_, _, k, quantized, _), m, (tiles, waves, stages) in jobs[part::parts]:
        x = torch.randn(m, k, device=device).to(args.dtype)
        fp8 = quantized[0]
        gemm.batched_matmul(x[None], fp8.weight[None], b_scale=fp8, tiles=tiles, waves=waves, stages=stages)


def sweep(args, device: torch.device) -> list[dict]:
    repeats, inner = (1, 1) if args.tiny else (7, INNER)
    g = torch.Generator(device=device).manual_seed(2)
    rows = []
    for shape, n, k, quantized, dense in cases(args, device):
        for m in args.row_list:
            x = torch.randn(m, k, generator=g, device=device).to(args.dtype)
            reference = F.linear(x, dense[0]).float()
            cublas = rotating([functools.partial(F.linear, x, w) for w in dense])
            production = rotating([functools.partial(gemm.matmul, x, q, fixed_tiles=False) for q in quantized])
            row = {"shape": shape, "n": n, "k": k, "m": m, "copies": [len(quantized), len(dense)],
                   "cublas_bf16_ms": replayed_ms(cublas, device, repeats, inner),
                   "production_ms": replayed_ms(production, device, repeats, inner), "tilings_ms": {}}  # fmt: skip
            worst = 0.0
            for spec in tilings(m, args.tiny):
                tiles, waves, stages = spec
                calls = [functools.partial(gemm.batched_matmul, x[None], q.weight[None], b_scale=q, tiles=tiles,
                                           waves=waves, stages=stages) for q in quantized]  # fmt: skip
                worst = max(worst, float((calls[0]()[0].float() - reference).abs().max()))
                row["tilings_ms"][name(spec)] = replayed_ms(rotating(calls), device, repeats, inner)
            best = min(row["tilings_ms"], key=row["tilings_ms"].get)
            row.update(best=best, best_ms=row["tilings_ms"][best], max_abs_vs_bf16=worst,
                       best_speedup_vs_cublas_bf16=row["cublas_bf16_ms"] / row["tilings_ms"][best],
                       production_speedup_vs_cublas_bf16=row["cublas_bf16_ms"] / row["production_ms"])  # fmt: skip
            rows.append(row)
            print(f"{shape} m={m} cublas {row['cublas_bf16_ms'] * 1e3:.1f} us, production "
                  f"{row['production_ms'] * 1e3:.1f}, best {best} {row['best_ms'] * 1e3:.1f}", flush=True)  # fmt: skip
    return rows


def spec_of(tiling_name: str) -> tuple:
    bm, bn, bk, warps, waves, stages = map(int, re.fullmatch(NAME, tiling_name).groups())
    return ((bm, bn, bk, warps), waves, stages)


def table(results: list[dict]) -> str:
    """kernels/fp8_tilings' MEASURED and GENERIC literals from sweeps. A later sweep's (shape, rows) replaces an
    earlier one's only where its fastest tiling beat production's (the table's entry then) in that same run: a
    wider grid's pick that merely ties within the timing noise leaves the entry as it was. MEASURED: per (N, K), per
    row count, the fastest tiling; GENERIC: per row count the tiling fastest over all shapes together (among the
    tilings every shape was timed in)."""
    latest: dict[tuple[int, int, int], dict] = {}
    for result in results:
        for r in result["rows"]:
            key = (r["n"], r["k"], r["m"])
            if key not in latest or r["best_ms"] < r["production_ms"]:
                latest[key] = r
    measured: dict[tuple[int, int], dict[int, tuple]] = {}
    totals: dict[int, dict[str, float]] = {}
    counts: dict[int, dict[str, int]] = {}
    for (n, k, m), r in latest.items():
        measured.setdefault((n, k), {})[m] = spec_of(r["best"])
        for tiling_name, ms in r["tilings_ms"].items():
            totals.setdefault(m, {}).setdefault(tiling_name, 0.0)
            totals[m][tiling_name] += ms
            counts.setdefault(m, {}).setdefault(tiling_name, 0)
            counts[m][tiling_name] += 1
    generic = {}
    for m in sorted(totals):
        shapes = max(counts[m].values())
        everywhere = {name_: ms for name_, ms in totals[m].items() if counts[m][name_] == shapes}
        generic[m] = spec_of(min(everywhere, key=everywhere.get))
    lines = [TABLE_START, "MEASURED: dict[tuple[int, int], dict[int, Tiling]] = {"]
    for (n, k), specs in measured.items():
        lines += [f"    ({n}, {k}): {{", *(f"        {m}: {spec!r}," for m, spec in sorted(specs.items())), "    },"]
    lines += ["}", "", "GENERIC: dict[int, Tiling] = {", *(f"    {m}: {spec!r}," for m, spec in generic.items()), "}"]
    return "\n".join([*lines, TABLE_END])


def write_table(text: str, module: Path) -> None:
    """Replace the table between its markers in kernels/fp8_tilings.py."""
    source = module.read_text()
    start, end = source.index(TABLE_START), source.index(TABLE_END) + len(TABLE_END)
    module.write_text(source[:start] + text + source[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes under the interpreter: a CPU smoke run")
    parser.add_argument("--rows", default=None, help="rows M (default 1,16,32,64,128,256)")
    parser.add_argument("--shapes", default=None, help="projection names, comma-separated (default: all seven)")
    parser.add_argument("--jobs", type=int, default=14, help="processes compiling the kernels before the timing")
    parser.add_argument("--compile-part", default=None, help=argparse.SUPPRESS)  # "i/n": one compiling process
    parser.add_argument("--table", nargs="+", default=None,
                        help="print kernels/fp8_tilings' table from these results (a later one's row replaces an "
                        "earlier one's where it beat production) and stop")  # fmt: skip
    parser.add_argument("--write", action="store_true", help="with --table: write it into kernels/fp8_tilings.py")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.table:
        text = table([json.loads(Path(path).read_text()) for path in args.table])
        write_table(text, MODULE) if args.write else print(text)
        return 0
    args.row_list = [int(m) for m in (args.rows or ("1,5" if args.tiny else "1,16,32,64,128,256")).split(",")]
    args.shapes = args.shapes.split(",") if args.shapes else None
    device = torch.device("cpu" if args.tiny else "cuda")
    args.dtype = torch.float32 if args.tiny else torch.bfloat16
    if args.compile_part:
        part, parts = map(int, args.compile_part.split("/"))
        compile_part(args, device, part, parts)
        return 0
    if args.out is None:
        parser.error("--out is required")
    started = time.perf_counter()
    if not args.tiny and args.jobs > 1:
        argv_ = [a for a in (argv if argv is not None else sys.argv[1:])]
        procs = [subprocess.Popen([sys.executable, __file__, *argv_, "--compile-part", f"{i}/{args.jobs}"])
                 for i in range(args.jobs)]  # fmt: skip
        if any(p.wait() for p in procs):
            print("a compiling process failed: see its error above", file=sys.stderr)
            return 1
    compiled = time.perf_counter()
    report = {
        "benchmark": "gpu_fp8_tilings",
        "command": " ".join(["python", "bench/gpu_fp8_tilings.py", *(argv if argv is not None else sys.argv[1:])]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {**machine(), "device": device_info(device)},
        "versions": versions(),
        "method": "median of 7 timings of 20 calls replayed as one CUDA graph, each call on the next copy of the "
        "weight (copies spanning 4 x L2: read from HBM); FP8: 128 x 128 blocks, E8M0 "
        "scales, random N(0, 1/K) weights; cuBLAS (F.linear) on the same values in bf16; production = "
        "gemm.matmul(fixed_tiles=False) as the default mode runs it; tilings named bm_bn_bk_warps_waves_stages",
        "rows": sweep(args, device),
    }
    report["seconds"] = {"compile": compiled - started, "time": time.perf_counter() - compiled}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
