"""Grouped expert GEMMs for `expert_ffn`: rows sorted by expert, one launch per GEMM for all experts.

The row tiles of each expert are found inside the kernel from `tokens_per_expert` (a device tensor),
so nothing is read back to the host and the launch is capturable in a device graph: the grid has
cdiv(rows, BM) + min(E, rows) row tiles, an upper bound on the tiles the experts need (each expert with rows adds
at most one part-filled tile, and at most `rows` experts have any), and the spare ones exit.
The first GEMM fuses the SiLU-and-multiply epilogue (gate and up columns in one program; with V4's
swiglu_limit the clamp too, a constexpr specialisation, so no limit costs nothing; with V4.1's row scales
the routing weight too, another one); the second maps back to the hidden size. A row's result depends on
its own row and expert only: batch-invariant.

In default mode at prefill sizes (LARGE_ROWS_PER_EXPERT rows per expert and more), with 16-bit weights on an
SM90+ GPU, torch._grouped_mm (CUTLASS's grouped GEMM, Hopper's TMA / warp-specialised tiles) runs the two
GEMMs instead, around the activation kernel; decode sizes, batch-invariant mode and FP8 weights stay here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia_sm100.kernels._common import INTERPRET, dot_in_float32, next_pow2
from deepinfer_nvidia_sm100.kernels.elementwise import limit_in, silu_and_mul, silu_mul_float32, silu_mul_rounded
from deepinfer_nvidia_sm100.kernels.quant import (
    DENSE,
    MXFP4_SCALED_DOT,
    WeightArgs,
    a_tile,
    check_tiles,
    finish,
    for_activations,
    scale_strides,
    weight_args,
    weight_mma,
)


@triton.jit
def _locate_tile(counts_ptr, E, pid_m, BE: tl.constexpr, BM: tl.constexpr):
    """Row tile `pid_m` of the grid -> (expert, first row, end of that expert's rows); expert == E: spare."""
    experts = tl.arange(0, BE)
    counts = tl.load(counts_ptr + experts, mask=experts < E, other=0).to(tl.int32)
    tiles = (counts + BM - 1) // BM
    tile_end = tl.cumsum(tiles, axis=0)
    row_end = tl.cumsum(counts, axis=0)
    expert = tl.sum((tile_end <= pid_m).to(tl.int32), axis=0)
    here = experts == expert
    first_tile = tl.sum(tl.where(here, tile_end - tiles, 0), axis=0)
    first_row = tl.sum(tl.where(here, row_end - counts, 0), axis=0)
    last_row = tl.sum(tl.where(here, row_end, 0), axis=0)
    return expert, first_row + (pid_m - first_tile) * BM, last_row


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, scale_ptr, counts_ptr, act_ptr, row_scales_ptr, D, INNER, E, sx_m, sw_e, sw_n, ss_e, ss_n, ss_k,
    sa_m, limit, F32: tl.constexpr, FORMAT: tl.constexpr, QBN: tl.constexpr, QBK: tl.constexpr, HAS_LIMIT: tl.constexpr,
    ROW_SCALED: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    expert, row0, row_end = _locate_tile(counts_ptr, E, tl.program_id(0), BE, BM)
    if expert >= E:
        return
    rm = row0 + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * sx_m
    w, scales = w_ptr + expert.to(tl.int64) * sw_e, scale_ptr + expert.to(tl.int64) * ss_e
    acc_gate = tl.zeros((BM, BN), dtype=tl.float32)
    acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, D, BK):
        a, a_odd = a_tile(x_rows, 1, rm[:, None] < row_end, k, D, FORMAT, BK)
        acc_gate = weight_mma(acc_gate, a, a_odd, w, sw_n, 1, rn, INNER, k, D, scales, ss_n, ss_k, F32, FORMAT, QBN,
                              QBK, BK, BN)  # fmt: skip
        acc_up = weight_mma(acc_up, a, a_odd, w, sw_n, 1, rn + INNER, 2 * INNER, k, D, scales, ss_n, ss_k, F32, FORMAT,
                            QBN, QBK, BK, BN)  # fmt: skip
    acc_gate, acc_up = finish(acc_gate, FORMAT), finish(acc_up, FORMAT)
    dtype = act_ptr.dtype.element_ty
    # the GEMM output is rounded first; HAS_LIMIT: then clamped (V4's swiglu_limit), as silu_and_mul does
    if ROW_SCALED:  # V4.1: times each row's routing weight in float32, then the one rounding to dtype
        row_scale = tl.load(row_scales_ptr + rm, mask=rm < row_end, other=0.0)  # [BM] float32, rows as x's
        act = silu_mul_float32(acc_gate.to(dtype), acc_up.to(dtype), limit, HAS_LIMIT)
        act = (act * row_scale[:, None]).to(dtype)
    else:
        act = silu_mul_rounded(acc_gate.to(dtype), acc_up.to(dtype), dtype, limit, HAS_LIMIT)
    mask = (rm[:, None] < row_end) & (rn[None, :] < INNER)
    tl.store(act_ptr + rm[:, None].to(tl.int64) * sa_m + rn[None, :], act, mask=mask)


@triton.jit
def _down_kernel(
    a_ptr, w_ptr, scale_ptr, counts_ptr, out_ptr, D, INNER, E, sa_m, sw_e, sw_n, ss_e, ss_n, ss_k, so_m,
    F32: tl.constexpr, FORMAT: tl.constexpr, QBN: tl.constexpr, QBK: tl.constexpr,
    BE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    expert, row0, row_end = _locate_tile(counts_ptr, E, tl.program_id(0), BE, BM)
    if expert >= E:
        return
    rm = row0 + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    a_rows = a_ptr + rm[:, None].to(tl.int64) * sa_m
    w, scales = w_ptr + expert.to(tl.int64) * sw_e, scale_ptr + expert.to(tl.int64) * ss_e
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, INNER, BK):
        a, a_odd = a_tile(a_rows, 1, rm[:, None] < row_end, k, INNER, FORMAT, BK)
        acc = weight_mma(acc, a, a_odd, w, sw_n, 1, rn, D, k, INNER, scales, ss_n, ss_k, F32, FORMAT, QBN, QBK, BK, BN)
    acc = finish(acc, FORMAT)
    mask = (rm[:, None] < row_end) & (rn[None, :] < D)
    tl.store(out_ptr + rm[:, None].to(tl.int64) * so_m + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def _tiles(dtype: torch.dtype, size: str) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, num_warps, num_stages). `size` "large" picks bigger tiles for many rows per expert
    (prefill); batch-invariant mode never asks for them, so there the tiling is fixed per dtype."""
    if INTERPRET:
        return 16, 32, 32, 4, 1
    if dtype == torch.float32:
        return 64, 32, 32, 4, 2
    if size == "large":
        return 128, 128, 64, 8, 3
    if size == "small":  # MXFP4 upcast at decode sizes: 16-row tiles waste less upcasting
        return 16, 64, 128, 4, 4
    return 64, 64, 64, 4, 4


LARGE_ROWS_PER_EXPERT = 512  # from here on the 128 x 128 tiles win (compute-bound, prefill-sized)
SMALL_ROWS_PER_EXPERT = 16  # MXFP4 below this: 16-row tiles (each row tile upcasts its weights again)


def _weight_args(w, dtype: torch.dtype, small: bool) -> WeightArgs:
    """A dense, BlockFP8 or MXFP4 expert weight [E, N, K] as the kernels take it for `dtype` activations in `small`
    tiles or not, contiguous."""
    args = for_activations(weight_args(w), dtype, small)
    return args._replace(
        values=args.values.contiguous(), scales=None if args.scales is None else args.scales.contiguous()
    )


def expert_ffn(
    x: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    w13,
    w2,
    fixed_tiles: bool = True,
    swiglu_limit: float | None = None,
    row_scales: torch.Tensor | None = None,
    tiles: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """x [N, D] rows sorted by expert, tokens_per_expert [E], w13 [E, 2I, D], w2 [E, D, I] -> [N, D];
    either weight may be a BlockFP8 (scale blocks spanning or dividing the K tiles) or an MXFP4.

    fixed_tiles=False lets the tile size follow the number of rows (faster prefill, not batch-invariant).
    swiglu_limit (V4): the fused activation clamps as `silu_and_mul(limit=)` does, in the same kernel.
    row_scales [N] (V4.1's routing weights): the activation stays float32 (clamped in float32), is multiplied
    by its row's scale and only then rounded to x.dtype, in the same epilogue.
    tiles (BM, BN, BK, warps, stages): another fixed tiling, for bench/gpu_quant_kernels.py to compare (none depends
    on the rows: each is batch-invariant); production takes the defaults."""
    rows, hidden = x.shape
    if row_scales is not None and tuple(row_scales.shape) != (rows,):
        raise ValueError(f"row_scales has shape {tuple(row_scales.shape)}; expected one scale per row of x, ({rows},)")
    experts, inner = w13.shape[0], w2.shape[2]
    out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    x = x.contiguous()
    act = torch.empty((rows, inner), dtype=x.dtype, device=x.device)
    # (narrower 32-column tiles for fewer rows than experts were tried: 0.2 ms slower per step at batch 1 on
    # the H200, bench/README.md)
    size = "large" if not fixed_tiles and rows >= LARGE_ROWS_PER_EXPERT * experts else "fixed"
    fp4_rows = for_activations(weight_args(w13), x.dtype).format == MXFP4_SCALED_DOT
    if not fixed_tiles and fp4_rows and rows < SMALL_ROWS_PER_EXPERT * experts:
        size = "small"
    g13, g2 = _weight_args(w13, x.dtype, size == "small"), _weight_args(w2, x.dtype, size == "small")
    dense = g13.format == DENSE and g2.format == DENSE
    if tiles is None and size == "large" and dense and _torch_grouped_mm_takes(x, g13.values, g2.values):
        return _torch_grouped_ffn(x, _counts_on(tokens_per_expert, x), g13.values, g2.values, swiglu_limit, row_scales)
    bm, bn, bk, warps, stages = tiles or _tiles(x.dtype, size)
    check_tiles(g13, bk)
    check_tiles(g2, bk)
    row_tiles = triton.cdiv(rows, bm) + min(experts, rows)  # at decode sizes far fewer than E (V4 Flash: 256)
    common = dict(F32=dot_in_float32(x.dtype), BE=next_pow2(experts), BM=bm, BN=bn, BK=bk, num_warps=warps)
    if not INTERPRET:
        common["num_stages"] = stages
    counts = _counts_on(tokens_per_expert, x)

    def weight(args: WeightArgs) -> tuple[list, dict]:
        """(the weight's tensors and strides, its constexprs) for the kernels."""
        scale, *strides = scale_strides(args, out)
        values = args.values
        flags = dict(FORMAT=args.format, QBN=args.block[0], QBK=args.block[1])
        return [values, scale, values.stride(0), values.stride(1), *strides], flags

    (w13_, s13, sw_e, sw_n, ss_e, ss_n, ss_k), flags13 = weight(g13)
    row_scaled = row_scales is not None
    # the clamp happens in x.dtype as silu_and_mul's does, or in float32 before the row scale
    limit, has_limit = limit_in(swiglu_limit, torch.float32 if row_scaled else x.dtype)
    scales = row_scales.to(device=x.device, dtype=torch.float32).contiguous() if row_scaled else act
    _gate_up_kernel[(row_tiles, triton.cdiv(inner, bn))](
        x, w13_, s13, counts, act, scales, hidden, inner, experts, x.stride(0), sw_e, sw_n, ss_e, ss_n, ss_k,
        act.stride(0), limit, HAS_LIMIT=has_limit, ROW_SCALED=row_scaled, **flags13, **common,
    )  # fmt: skip
    (w2_, s2, sw_e, sw_n, ss_e, ss_n, ss_k), flags2 = weight(g2)
    _down_kernel[(row_tiles, triton.cdiv(hidden, bn))](
        act, w2_, s2, counts, out, hidden, inner, experts, act.stride(0), sw_e, sw_n, ss_e, ss_n, ss_k,
        out.stride(0), **flags2, **common,
    )  # fmt: skip
    return out


def _counts_on(tokens_per_expert: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return tokens_per_expert.to(device=x.device).contiguous()


def _torch_grouped_mm_takes(x: torch.Tensor, w13, w2) -> bool:
    """Whether torch's grouped GEMM (CUTLASS, SM90+) runs these prefill-sized GEMMs: 16-bit weights held as
    tensors (not BlockFP8), on a CUDA device of compute capability 9 or more, rows 16-byte aligned."""
    if not (x.is_cuda and hasattr(torch, "_grouped_mm")) or INTERPRET:
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or not all(isinstance(w, torch.Tensor) for w in (w13, w2)):
        return False
    if any(w.dtype != x.dtype for w in (w13, w2)) or torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    return all(n % 8 == 0 for n in (*w13.shape[1:], *w2.shape[1:]))


def _torch_grouped_ffn(x, counts, w13, w2, swiglu_limit, row_scales) -> torch.Tensor:
    """expert_ffn by torch._grouped_mm (default mode, prefill-sized; not batch-invariant): the gate-up GEMM, the
    activation kernel (as the reference rounds it: silu_and_mul of the rounded projections; with row scales,
    in float32 from the rounded projections, times the scale, rounded once), the down GEMM."""
    ends = torch.cumsum(counts, dim=0, dtype=torch.int32)  # [E]: each expert's last row + 1
    gate_up = torch._grouped_mm(x, w13.transpose(1, 2), offs=ends)  # [N, 2I] in x.dtype (torch 2.11: no other)
    if row_scales is None:
        act = silu_and_mul(gate_up, swiglu_limit)
    else:
        scaled = silu_and_mul(gate_up.float(), swiglu_limit) * row_scales.to(torch.float32)[:, None]
        act = scaled.to(x.dtype)
    return torch._grouped_mm(act, w2.transpose(1, 2), offs=ends)
