"""DeepSeek's weight formats in the nvidia_sm100 kernels, each timed alone against bf16 on the same values and
against the weight-read bound, in one run (issue #18):

- FP4 experts: kernels/moe.expert_ffn with MXFP4 w13 / w2 against the same values held in bf16, at V4 Flash's
  expert shapes (256 experts, hidden 4096, inner 2048, top-6) and the rows of decode batches;
- FP8 projections: kernels/gemm.matmul with V4's FP8 (128 x 128 blocks, E8M0 scales) against cuBLAS on the same
  values in bf16, at V4 Flash's dense projection shapes.

    python bench/gpu_quant_kernels.py --out bench/results/gpu_quant_kernels_nvidia_h200.json

Several tilings of each are timed: production's in the default mode (`default`: the tiling may follow the rows; FP4
experts at decode sizes: 16-row tiles upcast by quant.mxfp4_upcast) and in the batch-invariant one (`invariant`: one
tiling whatever the rows; FP4: Triton's dot_scaled), and other fixed ones (FP4: dot_scaled). --tiny: small
shapes under Triton's interpreter (a CPU smoke run; its times mean nothing).
"""

from __future__ import annotations

import argparse
import functools
import itertools
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

from deepinfer_core.backend.weight_formats import MXFP4, BlockFP8  # noqa: E402
from deepinfer_nvidia_sm100.kernels import gemm, moe  # noqa: E402

# (experts, hidden, inner, top-k): V4 Flash's routed experts; tiny: a CPU smoke shape
EXPERTS = {"full": (256, 4096, 2048, 6), "tiny": (8, 64, 64, 2)}
# name, N, K: V4 Flash's dense projections (hidden 4096, q_lora 1024, 64 heads x 512, o_lora 1024, shared expert)
PROJECTIONS = {
    "full": [("q_a", 1024, 4096), ("q_b", 32768, 1024), ("kv", 512, 4096), ("o_a", 8192, 4096),
             ("o_b", 4096, 8192), ("shared_gate_up", 4096, 4096), ("shared_down", 4096, 2048)],
    "tiny": [("a", 64, 128)],
}  # fmt: skip
# name: (BM, BN, BK, warps, stages); "default" / "invariant": production's tiling in that mode
FFN_TILINGS = {
    "full": {
        "default": None,
        "invariant": None,
        "dot_scaled_bm16": (16, 64, 128, 4, 4),  # Triton's dot_scaled at the upcast's tiles (the default before)
        "dot_scaled_bm16_bk256": (16, 64, 256, 4, 3),
        "dot_scaled_bm64_bk128": (64, 64, 128, 4, 3),
    },
    "tiny": {"default": None, "invariant": None, "bk64": (16, 32, 64, 4, 1)},
}
# name: ((BM, BN, BK, warps), waves, stages); "default" / "invariant": production's tiling in that mode
GEMM_TILINGS = {
    "full": {
        "default": None,
        "invariant": None,
        "bm16_bk128": ((16, 64, 128, 4), 1, 4),
        "bn128_waves2": ((64, 128, 64, 4), 2, 3),
        "bm128_bn128_w8": ((128, 128, 64, 8), 1, 3),
    },
    "tiny": {"default": None, "invariant": None, "bm16": ((16, 32, 32, 4), 1, 1)},
}


def expert_rows(batch: int, experts: int, top_k: int, device: torch.device, seed: int) -> torch.Tensor:
    """tokens_per_expert [E] of `batch` tokens routed uniformly at random to top_k distinct experts each."""
    g = torch.Generator().manual_seed(seed)
    chosen = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(batch)])
    return torch.bincount(chosen.flatten(), minlength=experts).to(device)


def random_mxfp4(shape: tuple[int, ...], device: torch.device, g: torch.Generator) -> MXFP4:
    """Uniformly random codes; scales 2^-8 .. 2^-5 (weights of about 0.01-0.2, as a trained FFN's)."""
    *lead, n, k = shape
    packed = torch.randint(0, 256, (*lead, n, k // 2), generator=g, device=device, dtype=torch.uint8)
    scales = torch.randint(119, 123, (*lead, n, k // 32), generator=g, device=device, dtype=torch.uint8)
    return MXFP4(packed, scales.view(torch.float8_e8m0fnu))


def dequantized(weight: MXFP4, dtype: torch.dtype, chunk: int = 16) -> torch.Tensor:
    """The bf16 weight a loader gives a backend without MXFP4 (per chunk of experts: float32 is 4 bytes a value)."""
    parts = [MXFP4(weight.weight[i : i + chunk], weight.scale[i : i + chunk]).dequantize().to(dtype)
             for i in range(0, weight.weight.shape[0], chunk)]  # fmt: skip
    return torch.cat(parts)


def ffn_rows(args, device: torch.device, dtype: torch.dtype, bandwidth: float, repeats: int, inner: int) -> list:
    size = "tiny" if args.tiny else "full"
    experts, hidden, inter, top_k = EXPERTS[size]
    g = torch.Generator(device=device).manual_seed(0)
    w13, w2 = random_mxfp4((experts, 2 * inter, hidden), device, g), random_mxfp4((experts, hidden, inter), device, g)
    b13, b2 = dequantized(w13, dtype), dequantized(w2, dtype)
    bytes_per_expert = {
        "bfloat16": (b13[0].numel() + b2[0].numel()) * b13.element_size(),
        "mxfp4": sum(t[0].numel() * t.element_size() for t in (w13.weight, w13.scale, w2.weight, w2.scale)),
    }
    rows = []
    for batch in args.batch_list:
        counts = expert_rows(batch, experts, top_k, device, seed=batch)
        x = (torch.randn(int(counts.sum()), hidden, generator=g, device=device) * 0.5).to(dtype)
        touched = int((counts > 0).sum())
        row = {"batch": batch, "rows": int(counts.sum()), "experts_touched": touched}
        for fmt, nbytes in bytes_per_expert.items():
            row[f"{fmt}_bound_ms"] = touched * nbytes / bandwidth * 1e3
        bf16 = functools.partial(moe.expert_ffn, x, counts, b13, b2, fixed_tiles=False)  # what the default mode runs
        reference = bf16()
        row["bf16_ms"] = replayed_ms(bf16, device, repeats, inner)
        row["bf16_fraction_of_bound"] = row["bfloat16_bound_ms"] / row["bf16_ms"]
        for name, tiles in FFN_TILINGS[size].items():
            call = functools.partial(moe.expert_ffn, x, counts, w13, w2, fixed_tiles=name != "default", tiles=tiles)
            row[f"fp4_{name}_max_abs_vs_bf16"] = float((call().float() - reference.float()).abs().max())
            row[f"fp4_{name}_ms"] = ms = replayed_ms(call, device, repeats, inner)
            row[f"fp4_{name}_speedup_vs_bf16"] = row["bf16_ms"] / ms
            row[f"fp4_{name}_fraction_of_bound"] = row["mxfp4_bound_ms"] / ms
        rows.append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return rows


L2_BYTES = 50 << 20  # the H200's L2


def rotating(calls: list) -> callable:
    """One call a time, each the next of `calls` (weights in turn): in a replayed graph every call reads another
    copy of the weight, out of HBM as in a model's step (its layers' weights), not out of L2."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def copies(weight, inner: int) -> list:
    """`weight` and copies of it (a tensor or a BlockFP8) whose turn spans 4 x L2, at most one per replayed call."""
    count = max(2, min(inner, -(-4 * L2_BYTES // weight.nbytes)))
    if isinstance(weight, BlockFP8):
        return [weight] + [
            BlockFP8(weight.weight.clone(), weight.scale.clone(), weight.block) for _ in range(count - 1)
        ]
    return [weight] + [weight.clone() for _ in range(count - 1)]


def gemm_rows(args, device: torch.device, dtype: torch.dtype, bandwidth: float, repeats: int, inner: int) -> list:
    size = "tiny" if args.tiny else "full"
    g = torch.Generator(device=device).manual_seed(1)
    rows = []
    for name, n, k in PROJECTIONS[size]:
        fp8 = BlockFP8.quantize(torch.randn(n, k, generator=g, device=device) * k**-0.5, (128, 128), "e8m0")
        weight = fp8.dequantize().to(dtype)
        for m in args.row_list:
            x = torch.randn(m, k, generator=g, device=device).to(dtype)
            row = {"shape": name, "n": n, "k": k, "m": m, "bf16_bound_ms": n * k * 2 / bandwidth * 1e3,
                   "fp8_bound_ms": (fp8.weight.numel() + fp8.scale.numel()) / bandwidth * 1e3}  # fmt: skip
            cublas = functools.partial(F.linear, x, weight)
            reference = cublas()
            row["cublas_bf16_ms"] = replayed_ms(cublas, device, repeats, inner)
            # cold: each call of the replay on another copy of the weight (out of HBM, as in a model's step)
            dense, quantized = copies(weight, inner), copies(fp8, inner)
            cold_cublas = rotating([functools.partial(F.linear, x, w) for w in dense])
            cold_fp8 = rotating([functools.partial(gemm.matmul, x, q, fixed_tiles=False) for q in quantized])
            row["cublas_bf16_cold_ms"] = replayed_ms(cold_cublas, device, repeats, inner)
            row["fp8_default_cold_ms"] = replayed_ms(cold_fp8, device, repeats, inner)
            row["fp8_default_cold_speedup_vs_cublas_bf16"] = row["cublas_bf16_cold_ms"] / row["fp8_default_cold_ms"]
            del dense, quantized, cold_cublas, cold_fp8
            for tiling, spec in GEMM_TILINGS[size].items():
                if spec is None:  # production's, in the default mode or the batch-invariant one
                    call = functools.partial(gemm.matmul, x, fp8, fixed_tiles=tiling == "invariant")
                else:
                    tiles, waves, stages = spec
                    call = functools.partial(gemm.batched_matmul, x[None], fp8.weight[None], b_scale=fp8,
                                             tiles=tiles, waves=waves, stages=stages)  # fmt: skip
                got = call().reshape(m, n)
                row[f"fp8_{tiling}_max_abs_vs_bf16"] = float((got.float() - reference.float()).abs().max())
                row[f"fp8_{tiling}_ms"] = ms = replayed_ms(call, device, repeats, inner)
                row[f"fp8_{tiling}_speedup_vs_cublas_bf16"] = row["cublas_bf16_ms"] / ms
            rows.append(row)
            print(json.dumps({k_: round(v, 4) if isinstance(v, float) else v for k_, v in row.items()}), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes under the interpreter: a CPU smoke run")
    parser.add_argument("--batches", default=None, help="decode batches for the expert FFN (default 1,16,64,256)")
    parser.add_argument("--rows", default=None, help="rows M for the projections (default 1,16,64,256)")
    parser.add_argument("--skip-gemm", action="store_true", help="time the expert FFN only")
    parser.add_argument("--skip-ffn", action="store_true", help="time the FP8 projections only")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    args.batch_list = [int(b) for b in (args.batches or ("1,3" if args.tiny else "1,16,64,256")).split(",")]
    args.row_list = [int(m) for m in (args.rows or ("1,5" if args.tiny else "1,16,64,256")).split(",")]
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    repeats, inner = (1, 1) if args.tiny else (7, 20)
    copy = measure_copy_bandwidth(device, 16 if args.tiny else 2048)
    bandwidth = copy["gb_per_s"] * 1e9
    report = {
        "benchmark": "gpu_quant_kernels",
        "command": " ".join(["python", "bench/gpu_quant_kernels.py", *(argv if argv is not None else sys.argv[1:])]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {**machine(), "device": device_info(device)},
        "versions": versions(),
        "dtype": str(dtype),
        "experts": dict(zip(("experts", "hidden", "inner", "top_k"), EXPERTS["tiny" if args.tiny else "full"])),
        "ffn_tilings_bm_bn_bk_warps_stages": FFN_TILINGS["tiny" if args.tiny else "full"],
        "gemm_tilings_bm_bn_bk_warps_waves_stages": GEMM_TILINGS["tiny" if args.tiny else "full"],
        "method": f"median of {repeats} timings of {inner} calls replayed as one CUDA graph (on a GPU); expert FFN: "
        "each token routed to top_k distinct experts uniformly at random, MXFP4 codes and scales (2^-8..2^-5) "
        "random, bf16 = the same values dequantized; *_bound_ms = bytes of the touched experts' (or the "
        "projection's) weights and scales / copy bandwidth; FP8: 128 x 128 blocks, E8M0 scales, cuBLAS on the same "
        "values in bf16; *_cold_ms: each replayed call on another copy of the weight (copies spanning 4 x L2): "
        "read from HBM, as a model step's layers read theirs (the others: the same weight each call, L2-resident "
        "when it fits)",
        "copy_bandwidth": copy,
        "expert_ffn": [] if args.skip_ffn else ffn_rows(args, device, dtype, bandwidth, repeats, inner),
        "fp8_projections": [] if args.skip_gemm else gemm_rows(args, device, dtype, bandwidth, repeats, inner),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
