"""The batch-invariant mode's dense GEMM (kernels/gemm.py: one fixed tiling per dtype, K splits chosen from the
weight's shape alone) against cuBLAS (torch's F.linear, what the default mode runs) and the weight-read bound,
at DeepSeek-V4.1 Flash's projection shapes and a range of row counts, in one run: which fixed tiling would bring
the batch-invariant mode nearest the default one (issue #16).

    python bench/gpu_gemm.py --out bench/results/gpu_gemm_nvidia_h200.json

Each tiling is batch-invariant (none depends on M); `current` is production's. --tiny: small shapes under
Triton's interpreter (a CPU smoke run; its times mean nothing).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

if "--tiny" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, versions  # noqa: E402
from _gpu_measure import device_info, measure_copy_bandwidth, replayed_ms  # noqa: E402

from deepinfer_nvidia_sm100.kernels import gemm  # noqa: E402

# (name, N, K): V4.1 Flash's dense projections (hidden 5120, q_lora 1280, 64 heads x 512, o_groups 8 x 1024,
# index 32 heads x 128, shared expert 2304)
SHAPES = [
    ("q_a", 1280, 5120),
    ("q_b", 32768, 1280),
    ("kv", 512, 5120),
    ("o_b", 5120, 8192),
    ("index_q", 4096, 1280),
    ("shared_gate_up", 4608, 5120),
    ("shared_down", 5120, 2304),
]
TINY_SHAPES = [("a", 64, 96), ("b", 96, 64)]
# name: (BM, BN, BK, warps), waves, stages
TILINGS = {
    "current": (None, 1, 3),
    "bn128_waves2": ((64, 128, 64, 4), 2, 3),
    "bk128_waves4": ((64, 64, 128, 4), 4, 3),
    "bm32_bk128_waves4": ((32, 64, 128, 4), 4, 4),
    "bm16_bn128_bk128_waves4": ((16, 128, 128, 4), 4, 4),
}
TINY_TILINGS = {"current": (None, 1, 3), "bm16": ((16, 32, 32, 4), 2, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes under the interpreter: a CPU smoke run")
    parser.add_argument("--rows", default=None, help="row counts M (default 1,16,64,256,2048; tiny 1,5)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.tiny else "cuda")
    shapes, tilings = (TINY_SHAPES, TINY_TILINGS) if args.tiny else (SHAPES, TILINGS)
    rows_list = [int(m) for m in (args.rows or ("1,5" if args.tiny else "1,16,64,256,2048")).split(",")]
    repeats, inner = (1, 1) if args.tiny else (7, 20)
    bandwidth = measure_copy_bandwidth(device, 16 if args.tiny else 2048)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    results = []
    for name, n, k in shapes:
        weight = (torch.randn(n, k, generator=g, device=device) * k**-0.5).to(dtype)
        bound_ms = n * k * weight.element_size() / (bandwidth["gb_per_s"] * 1e9) * 1e3
        for m in rows_list:
            x = torch.randn(m, k, generator=g, device=device).to(dtype)
            row = {"shape": name, "n": n, "k": k, "m": m, "weight_bound_ms": bound_ms}
            row["cublas_ms"] = replayed_ms(functools.partial(F.linear, x, weight), device, repeats, inner)
            reference = None
            for tiling, (tiles, waves, stages) in tilings.items():
                call = functools.partial(gemm.batched_matmul, x[None], weight[None], tiles=tiles, waves=waves,
                                         stages=stages)  # fmt: skip
                out = call()[0]
                reference = out if reference is None else reference
                row[f"{tiling}_ms"] = replayed_ms(call, device, repeats, inner)
                row[f"{tiling}_max_abs_vs_current"] = float((out.float() - reference.float()).abs().max())
            results.append(row)
            print(json.dumps({k_: round(v, 4) if isinstance(v, float) else v for k_, v in row.items()}), flush=True)
    report = {
        "benchmark": "gpu_gemm",
        "command": " ".join(["python", "bench/gpu_gemm.py", *(argv if argv is not None else sys.argv[1:])]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {**machine(), "device": device_info(device)},
        "versions": versions(),
        "dtype": str(dtype),
        "tilings": {name: {"tiles_bm_bn_bk_warps": t, "waves": w, "stages": s} for name, (t, w, s) in tilings.items()},
        "method": f"median of {repeats} timings of {inner} calls replayed as one CUDA graph (on a GPU), device "
        "synchronised around each; "
        "weight_bound_ms = the weight's bytes / copy bandwidth (activations not counted)",
        "copy_bandwidth": bandwidth,
        "rows": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
