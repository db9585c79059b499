"""A probe, not production: FP8 projections with the activations quantized too (W8A8: e4m3 activations with one
power-of-two scale per 1 x 128 block, as DeepSeek's inference code and vLLM's block-FP8 path run them) on the
GPU's FP8 MMA, against cuBLAS bf16 and production's weight-only FP8 GEMM (gemm.matmul, default mode), at V4
Flash's seven projection shapes (issue #18: what an FP8 MMA would buy where the in-register dequantization loses).

Three forms: `fused` quantizes each activation tile inside the GEMM (every column tile again); `pre` quantizes the
activations once in a kernel of their own, the GEMM then loads e4m3 rows and their scales; `cublas` quantizes them
the same way and hands both to cuBLASLt's block-scaled FP8 GEMM (`torch._scaled_mm` with 1 x 128 activation and
128 x 128 weight scales, CUDA 12.9+). Each multiplies each 128-column block's FP8 product by (activation scale x
weight scale) in float32. `*_cold_ms`: every replayed call reads another copy of the weight (out of HBM, as a
model's step reads its layers' weights; `gpu_quant_kernels.copies`). W8A8 changes the numerics (the
activations are rounded to e4m3): `*_err` is the max difference from the same W8A8 computed in float32 on the
GPU, relative to the largest output.

    python bench/gpu_w8a8_probe.py --rows 1,16,64,128,256 --out bench/results/gpu_w8a8_probe_nvidia_h200.json  # ~2 min
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, versions  # noqa: E402
from _gpu_measure import device_info, replayed_ms  # noqa: E402
from gpu_quant_kernels import PROJECTIONS, copies, rotating  # noqa: E402

from deepinfer_core.backend.weight_formats import BlockFP8  # noqa: E402
from deepinfer_nvidia_sm100.kernels import gemm  # noqa: E402
from deepinfer_nvidia_sm100.kernels.quant import e8m0_to_float  # noqa: E402

# name: (BM, BN, warps, stages, waves, form)
TILINGS = {
    **{f"fused_{k}": (*v, "fused") for k, v in {"bm16_bn64": (16, 64, 4, 4, 1), "bm32_bn64": (32, 64, 4, 4, 1),
       "bm64_bn64": (64, 64, 4, 4, 1), "bm64_bn64_waves2": (64, 64, 4, 4, 2), "bm64_bn128": (64, 128, 4, 3, 1),
       "bm128_bn128_w8": (128, 128, 8, 3, 1)}.items()},
    **{f"pre_{k}": (*v, "pre") for k, v in {"bm16_bn64": (16, 64, 4, 4, 1), "bm16_bn128": (16, 128, 4, 4, 1),
       "bm64_bn64": (64, 64, 4, 4, 1), "bm64_bn64_waves2": (64, 64, 4, 4, 2), "bm64_bn128": (64, 128, 4, 3, 1),
       "bm64_bn128_w8": (64, 128, 8, 4, 1), "bm128_bn128_w8": (128, 128, 8, 3, 1)}.items()},
}  # fmt: skip
BLOCK = 128  # activation and weight scale blocks along K


@triton.jit
def _pow2_scale(amax):
    """2^ceil(log2(amax / 448)): the smallest power of two that maps the block into e4m3 without clipping."""
    bits = (tl.maximum(amax, 1e-10) * (1.0 / 448.0)).to(tl.int32, bitcast=True)
    return ((bits + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_rows(a_ptr, q_ptr, s_ptr, K, sa_m, ss_m, ss_k, BK: tl.constexpr):
    row, kb = tl.program_id(0), tl.program_id(1)
    ks = kb * BK + tl.arange(0, BK)
    a = tl.load(a_ptr + row * sa_m + ks).to(tl.float32)
    s = _pow2_scale(tl.max(tl.abs(a)))
    tl.store(q_ptr + row * K + ks, (a * (1.0 / s)).to(tl.float8e4nv))
    tl.store(s_ptr + row * ss_m + kb * ss_k, s)


@triton.jit
def _w8a8_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, part_ptr, M, N, K, K_PER_SPLIT, sa_m, sw_n, ss_n, ss_k, sc_m,
    FUSED: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    pid, split = tl.program_id(0), tl.program_id(1)
    num_n = tl.cdiv(N, BN)
    rm = (pid // num_n) * BM + tl.arange(0, BM)
    rn = (pid % num_n) * BN + tl.arange(0, BN)
    k_lo = split * K_PER_SPLIT
    k_hi = tl.minimum(K, k_lo + K_PER_SPLIT)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(k_lo, k_hi, BK):
        ks = k + tl.arange(0, BK)
        rows_ok = (rm[:, None] < M) & (ks[None, :] < k_hi)
        if FUSED:  # bf16 rows, quantized here (by every column tile again)
            a = tl.load(a_ptr + rm[:, None] * sa_m + ks[None, :], mask=rows_ok, other=0.0).to(tl.float32)
            s = _pow2_scale(tl.max(tl.abs(a), axis=1))
            aq = (a * (1.0 / s)[:, None]).to(tl.float8e4nv)
        else:  # e4m3 rows and their scales, quantized by _quantize_rows
            aq = tl.load(a_ptr + rm[:, None] * K + ks[None, :], mask=rows_ok, other=0.0)
            s = tl.load(as_ptr + rm * (K // BK) + k // BK, mask=rm < M, other=0.0)
        w = tl.load(w_ptr + rn[None, :] * sw_n + ks[:, None], mask=(rn[None, :] < N) & (ks[:, None] < k_hi), other=0.0)
        w_scale = e8m0_to_float(tl.load(ws_ptr + (rn // BK) * ss_n + (k // BK) * ss_k, mask=rn < N, other=0))
        acc += tl.dot(aq, w) * (s[:, None] * w_scale[None, :])
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT == 1:
        tl.store(c_ptr + rm[:, None] * sc_m + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + (split * M + rm[:, None]) * N + rn[None, :], acc, mask=mask)


@triton.jit
def _sum_splits(part_ptr, c_ptr, MN, SPLIT: tl.constexpr, BLOCK_: tl.constexpr):
    idx = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    acc = tl.zeros((BLOCK_,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + s * MN + idx, mask=idx < MN, other=0.0)
    tl.store(c_ptr + idx, acc.to(c_ptr.dtype.element_ty), mask=idx < MN)


def w8a8(x: torch.Tensor, fp8: BlockFP8, bm: int, bn: int, warps: int, stages: int, waves: int, form: str):
    m, k = x.shape
    n = fp8.weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tiles, k_tiles = triton.cdiv(n, bn) * triton.cdiv(m, bm), k // BLOCK
    programs = waves * gemm.SM_COUNT_HINT  # the K splits as gemm.split_count picks them
    wanted = programs // tiles if 2 * tiles < programs else triton.cdiv(2 * programs, tiles)
    per_split = triton.cdiv(k_tiles, max(1, min(8 * waves, wanted, k_tiles // 4))) * BLOCK
    splits = triton.cdiv(k, per_split)
    parts = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else out
    scales = fp8.scale.view(torch.uint8)
    a, a_scales = x, x
    if form == "pre":
        a = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
        a_scales = torch.empty(m, k_tiles, dtype=torch.float32, device=x.device)
        _quantize_rows[(m, k_tiles)](x, a, a_scales, k, x.stride(0), *a_scales.stride(), BK=BLOCK)
    _w8a8_kernel[(tiles, splits)](
        a, a_scales, fp8.weight, scales, out, parts, m, n, k, per_split, x.stride(0), fp8.weight.stride(0),
        scales.stride(0), scales.stride(1), out.stride(0), FUSED=form == "fused", SPLIT=splits, BM=bm, BN=bn,
        BK=BLOCK, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if splits > 1:
        _sum_splits[(triton.cdiv(m * n, 1024),)](parts, out, m * n, SPLIT=splits, BLOCK_=1024)
    return out


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 rows [M, K] -> (e4m3 rows, float32 power-of-two scales [M, K / 128] laid out M-major, as cuBLASLt's 1 x
    128 scales are read)."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(k // BLOCK, m, dtype=torch.float32, device=x.device).t()
    _quantize_rows[(m, k // BLOCK)](x, q, scales, k, x.stride(0), *scales.stride(), BK=BLOCK)
    return q, scales


def cublas_w8a8(x: torch.Tensor, fp8: BlockFP8, weight_scales: torch.Tensor) -> torch.Tensor:
    """W8A8 on cuBLASLt's block-scaled FP8 GEMM; rows padded to a multiple of 4 (its scale alignment)."""
    m = x.shape[0]
    padded = x if m % 4 == 0 else F.pad(x, (0, 0, 0, -m % 4))
    q, scales = quantize_rows(padded)
    out = torch._scaled_mm(q, fp8.weight.t(), scales, weight_scales.t(), out_dtype=x.dtype)
    return out[:m]


def w8a8_reference(x: torch.Tensor, fp8: BlockFP8) -> torch.Tensor:
    """The same W8A8 in float32: activations rounded to e4m3 per 1 x 128 block with power-of-two scales."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    scale = torch.exp2(torch.ceil(torch.log2(blocks.abs().amax(-1, keepdim=True).clamp_min(1e-10) / 448)))
    rounded = (blocks / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    return rounded.reshape(m, k) @ fp8.dequantize().T


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16,64,256")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    device, dtype = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=device).manual_seed(1)
    rows = []
    for name, n, k in PROJECTIONS["full"]:
        fp8 = BlockFP8.quantize(torch.randn(n, k, generator=g, device=device) * k**-0.5, (128, 128), "e8m0")
        dense = fp8.dequantize().to(dtype)
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, generator=g, device=device).to(dtype)
            row = {"shape": name, "n": n, "k": k, "m": m,
                   "cublas_bf16_ms": replayed_ms(functools.partial(F.linear, x, dense), device, 20, 20),
                   "production_fp8_ms": replayed_ms(functools.partial(gemm.matmul, x, fp8, fixed_tiles=False),
                                                    device, 20, 20)}  # fmt: skip
            want = w8a8_reference(x, fp8)
            weight_scales = fp8.scale.float()
            forms = {f"{tiling}": functools.partial(w8a8, x, fp8, *spec) for tiling, spec in TILINGS.items()}
            forms["cublas"] = functools.partial(cublas_w8a8, x, fp8, weight_scales)
            for form, call in forms.items():
                try:
                    row[f"{form}_err"] = float((call().float() - want).abs().max() / want.abs().max())
                    row[f"{form}_ms"] = replayed_ms(call, device, 20, 20)
                except RuntimeError as error:  # e.g. a cuBLAS without block-scaled FP8 (before CUDA 12.9)
                    row[f"{form}_error"] = str(error).splitlines()[0]
            # cold: each replayed call on another copy of the weight, as a model's step reads its layers' weights
            quantized = copies(fp8, 20)
            cold = {
                "cublas_bf16": [functools.partial(F.linear, x, w) for w in copies(dense, 20)],
                "production_fp8": [functools.partial(gemm.matmul, x, q, fixed_tiles=False) for q in quantized],
                "pre_bm64_bn128": [functools.partial(w8a8, x, q, *TILINGS["pre_bm64_bn128"]) for q in quantized],
            }
            if "cublas_ms" in row:
                cold["cublas"] = [functools.partial(cublas_w8a8, x, q, q.scale.float()) for q in quantized]
            for form, calls in cold.items():
                row[f"{form}_cold_ms"] = replayed_ms(rotating(calls), device, 20, 20)
            del cold, quantized
            rows.append(row)
            print(json.dumps({key: round(v, 4) if isinstance(v, float) else v for key, v in row.items()}), flush=True)
    report = {
        "benchmark": "gpu_w8a8_probe",
        "command": " ".join(["python", "bench/gpu_w8a8_probe.py", *(argv if argv is not None else sys.argv[1:])]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {**machine(), "device": device_info(device)},
        "versions": versions(),
        "method": "median of 20 timings of 20 calls replayed as one CUDA graph: *_ms the same weight each call, "
        "*_cold_ms another copy of it each call (copies spanning 4 x L2)",
        "tilings_bm_bn_warps_stages_waves_form": TILINGS,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
