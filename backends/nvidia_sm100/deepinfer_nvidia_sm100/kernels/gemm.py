"""A batch-invariant GEMM: C[b] = A[b] @ B[b]^T (+ bias) with one fixed tiling per weight shape.

Every output element is reduced over K in the same order whatever M is: the tile sizes depend only
on the dtype, and the K range is cut into a fixed number of splits chosen from (N, K) alone, whose
float32 partial sums are added in split order by a second kernel. So a row's result does not depend
on how many other rows share the call — unlike a library GEMM, which picks its algorithm by M.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.backend.ops import MXFP4, BlockFP8
from deepinfer_nvidia_sm100.kernels import fp8_tilings, quant
from deepinfer_nvidia_sm100.kernels._common import INTERPRET, dot_in_float32
from deepinfer_nvidia_sm100.kernels.quant import a_tile, check_tiles, finish, for_activations, weight_args, weight_mma

SM_COUNT_HINT = 132  # programs to aim for on one wave; H200 has 132 SMs (a fixed number: results must not vary by GPU)


@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, bias_ptr, c_ptr, ws_ptr, scale_ptr, M, N, K, K_PER_SPLIT,
    sa_b, sa_m, sa_k, sb_b, sb_n, sb_k, sc_b, sc_m, sc_n, ss_b, ss_n, ss_k,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, F32: tl.constexpr, FORMAT: tl.constexpr,
    QBN: tl.constexpr, QBK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    pid, batch, split = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    num_n = tl.cdiv(N, BN)
    rm = (pid // num_n) * BM + tl.arange(0, BM)
    rn = (pid % num_n) * BN + tl.arange(0, BN)
    k_lo = split * K_PER_SPLIT
    k_hi = tl.minimum(K, k_lo + K_PER_SPLIT)
    a_rows = a_ptr + batch * sa_b + rm[:, None].to(tl.int64) * sa_m
    b_base, scale_base = b_ptr + batch * sb_b, scale_ptr + batch * ss_b
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(k_lo, k_hi, BK):
        a, a_odd = a_tile(a_rows, sa_k, rm[:, None] < M, k, k_hi, FORMAT, BK)
        acc = weight_mma(acc, a, a_odd, b_base, sb_n, sb_k, rn, N, k, k_hi, scale_base, ss_n, ss_k, F32, FORMAT, QBN,
                         QBK, BK, BN)  # fmt: skip
    acc = finish(acc, FORMAT)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        c = c_ptr + batch * sc_b + rm[:, None].to(tl.int64) * sc_m + rn[None, :] * sc_n
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        nb = tl.num_programs(1)
        ws = ws_ptr + ((split * nb + batch) * M + rm[:, None]) * N + rn[None, :]
        tl.store(ws, acc, mask=mask)


@triton.jit
def _split_sum_kernel(
    ws_ptr, bias_ptr, c_ptr, M, N, sc_b, sc_m, sc_n,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    batch, nb = tl.program_id(1).to(tl.int64), tl.num_programs(1)
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):  # in split order (the sum does not depend on M); unrolled: loads overlap
        acc += tl.load(ws_ptr + (split * nb + batch) * M * N + idx, mask=mask, other=0.0)
    m, n = idx // N, idx % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + batch * sc_b + m * sc_m + n * sc_n, acc.to(c_ptr.dtype.element_ty), mask=mask)


def _tiles(dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BM, BN, BK, num_warps): depends on the dtype only, never on M."""
    if INTERPRET:
        return 16, 32, 32, 4
    if dtype == torch.float32:  # IEEE products run on the FMA units: a small row tile wastes less at decode's few rows
        return 32, 32, 32, 4
    return 64, 64, 64, 4


def split_count(
    n: int, k: int, dtype: torch.dtype, tiles: tuple[int, int, int, int] | None = None, waves: int = 1,
    max_splits: int | None = None,
) -> int:  # fmt: skip
    """K splits for an [N, K] weight, a function of (N, K) only: at small M, enough programs to keep the weight
    streaming — one wave where the column tiles alone nearly fill one (more splits only add partial sums), about
    two waves where they fill half a wave or more (one program an SM does not keep enough bytes in flight).

    float32 (the routers, the hyper-connection mixers, the compressors' gates: few columns, long K, products on
    the FMA units) splits up to 128 ways, at least 2 K tiles a split; other dtypes up to 8 ways (the float32
    partials cost a prefill chunk more than they win), at least 4 K tiles a split."""
    _, bn, bk, _ = tiles or _tiles(dtype)
    n_tiles, k_tiles = triton.cdiv(n, bn), triton.cdiv(k, bk)
    wide = dtype == torch.float32
    limit = max_splits if max_splits is not None else (128 if wide else 8) * waves
    programs = waves * SM_COUNT_HINT
    wanted = programs // n_tiles if 2 * n_tiles < programs else triton.cdiv(2 * programs, n_tiles)
    return max(1, min(limit, wanted, k_tiles // (2 if wide else 4)))


def batched_matmul(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, b_scale: BlockFP8 | MXFP4 | None = None, *,
    tiles: tuple[int, int, int, int] | None = None, waves: int = 1, stages: int = 3, max_splits: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """a [G, M, K] @ b[G, N, K]^T (+ bias [N]) -> [G, M, N] in a.dtype, batch-invariant in M (any strides).

    b_scale: b is the float8 weight of this BlockFP8 (with a leading G dim on its scale; float32 or E8M0 scales,
    blocks spanning or dividing the K tile): each weight tile is dequantized in registers (rounded to a.dtype, as a
    dequantize-then-GEMM would), never in memory.
    tiles (BM, BN, BK, warps), waves, stages, max_splits: other fixed tilings, for bench/gpu_gemm.py to compare (each is
    batch-invariant too: none depends on M); production takes the defaults."""
    groups, m, k = a.shape
    n = b.shape[1]
    out = torch.empty((groups, m, n), dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand_as(out))
    bias = None if bias is None else bias.contiguous()
    bm, bn, bk, warps = tiles or _tiles(a.dtype)
    weight = for_activations(weight_args(b_scale if b_scale is not None else b), a.dtype)
    check_tiles(weight, bk)
    if weight.scales is not None:  # a leading G dim on the scales too
        weight = weight._replace(scales=weight.scales.reshape(groups, *weight.scales.shape[-2:]))
    scale, *scale_strides = quant.scale_strides(weight, out)
    splits = split_count(n, k, a.dtype, (bm, bn, bk, warps), waves, max_splits)
    k_per_split = triton.cdiv(triton.cdiv(k, bk), splits) * bk
    workspace = torch.empty((splits, groups, m, n), dtype=torch.float32, device=a.device) if splits > 1 else out
    launch = {} if INTERPRET else {"num_stages": stages}
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), groups, splits)
    _matmul_kernel[grid](
        a, b, bias if bias is not None else out, out, workspace, scale, m, n, k, k_per_split,
        *a.stride(), *b.stride(), *out.stride(), *scale_strides,
        HAS_BIAS=bias is not None and splits == 1, SPLIT_K=splits, F32=dot_in_float32(a.dtype),
        FORMAT=weight.format, QBN=weight.block[0], QBK=weight.block[1], BM=bm, BN=bn, BK=bk, num_warps=warps, **launch,
    )  # fmt: skip
    if splits > 1:
        block = 1024
        _split_sum_kernel[(triton.cdiv(m * n, block), groups)](
            workspace, bias if bias is not None else out, out, m, n, *out.stride(),
            HAS_BIAS=bias is not None, SPLIT_K=splits, BLOCK=block,
        )  # fmt: skip
    return out


SMALL_ROWS, LARGE_ROWS = 16, 128  # the default mode's MXFP4 GEMMs: 16-row tiles up to, 128 x 128 from


def quantized_tiling(rows: int, weight: BlockFP8 | MXFP4) -> dict:
    """The default mode's tiling of an FP8 / FP4 weight's GEMM by its rows. FP8: `fp8_tilings.tiling` (per shape and
    row count, measured on the H200). MXFP4: 16-row tiles with 128-column K steps up to SMALL_ROWS (they beat the
    fixed tiling and cuBLAS on the same weight in bf16 at decode's few rows), 128 x 128 tiles from LARGE_ROWS, the
    fixed tiling in between (bench/gpu_quant_kernels.py)."""
    if isinstance(weight, BlockFP8):
        return fp8_tilings.tiling(rows, *weight.shape)
    if rows <= SMALL_ROWS:
        return {"tiles": (16, 64, 128, 4), "waves": 2, "stages": 4}
    if rows >= LARGE_ROWS:
        return {"tiles": (128, 128, 64, 8), "waves": 1, "stages": 3}
    return {}


def matmul(
    x: torch.Tensor, weight: torch.Tensor | BlockFP8 | MXFP4, bias: torch.Tensor | None = None, fixed_tiles: bool = True
) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias) -> [..., N], batch-invariant in the leading dims (fixed_tiles=False:
    a quantized weight's tiling follows the rows, `quantized_tiling`: faster, not batch-invariant)."""
    rows = x.reshape(-1, x.shape[-1])
    quantized = isinstance(weight, (BlockFP8, MXFP4))
    values, scale = (weight.weight, weight) if quantized else (weight, None)
    tiling = quantized_tiling(rows.shape[0], weight) if quantized and not fixed_tiles else {}
    out = batched_matmul(rows[None], values[None], bias, b_scale=scale, **tiling)[0]
    return out.view(*x.shape[:-1], weight.shape[0])
