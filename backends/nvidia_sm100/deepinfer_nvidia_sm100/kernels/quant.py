"""Weight tiles for the GEMM kernels, dense or quantized (ops.BlockFP8, ops.MXFP4), dequantized in registers.

A quantized tile is read as stored (FP8: one byte a value; MXFP4: two values a byte) with its scales and turned
into the MMA's dtype right before the MMA: Hopper has no FP4 MMA, and an FP8 MMA would need the activations in
FP8 too. The value is the reference's `dequantize()` exactly: element x scale in float32 (exact: e2m1 and e4m3
times a power of two, or e4m3 times a float32 scale rounded once), then rounded to the dtype.

Formats (constexpr FORMAT): DENSE; FP8 (float32 scales); FP8_POW2 (E8M0 scale bytes); MXFP4 (E8M0 per 32 along
K). FP8 blocks may span whole K tiles (QBK a multiple of BK: one scale a column per tile) or divide them (V4.1's
32: BK / QBK scales a column).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deepinfer_core.backend.weight_formats import MX_BLOCK, MXFP4, BlockFP8

__all__ = [
    "DENSE",
    "FP8",
    "FP8_POW2",
    "MXFP4_FORMAT",
    "WeightArgs",
    "check_tiles",
    "scale_strides",
    "weight_args",
    "weight_tile",
]

DENSE, FP8, FP8_POW2, MXFP4_FORMAT = 0, 1, 2, 3


class WeightArgs(NamedTuple):
    """A weight as the kernels take it."""

    values: torch.Tensor  # dense, float8 or packed e2m1 bytes
    scales: torch.Tensor | None  # float32, or E8M0 bytes (uint8)
    format: int  # DENSE, FP8, FP8_POW2, MXFP4_FORMAT
    block: tuple[int, int]  # (QBN, QBK): rows and K columns a scale covers


def weight_args(weight) -> WeightArgs:
    """A dense tensor, ops.BlockFP8 or ops.MXFP4 -> the kernels' arguments (E8M0 scales as their bytes)."""
    if isinstance(weight, MXFP4):
        return WeightArgs(weight.weight, weight.scale.view(torch.uint8), MXFP4_FORMAT, (1, MX_BLOCK))
    if isinstance(weight, BlockFP8):
        if weight.pow2_scales:
            return WeightArgs(weight.weight, weight.scale.view(torch.uint8), FP8_POW2, weight.block)
        return WeightArgs(weight.weight, weight.scale, FP8, weight.block)
    return WeightArgs(weight, None, DENSE, (1, 1))


def check_tiles(args: WeightArgs, bk: int) -> None:
    """Raise ValueError where a weight's scale blocks neither span nor divide the K tile `bk`."""
    qbk = args.block[1]
    if args.format != DENSE and qbk % bk and bk % qbk:
        raise ValueError(f"quantization blocks of {qbk} columns neither span nor divide the kernel's {bk}-column tiles")


@triton.jit
def e8m0_to_float(byte):
    """E8M0 bytes -> 2^(byte - 127) in float32: byte 0 is 2^-127 (a subnormal), 255 is NaN."""
    b = byte.to(tl.int32)
    bits = tl.where(b == 0, 0x00400000, tl.where(b == 255, 0x7FC00000, b << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e2m1_to_float(code):
    """FP4 e2m1 codes (0..15: sign bit, then magnitude index) -> float32 (0, .5, 1, 1.5, 2, 3, 4, 6)."""
    c = code.to(tl.int32)
    m = (c & 7).to(tl.float32)
    magnitude = tl.where(m < 4, m * 0.5, tl.where(m < 7, m - 2.0, 6.0))
    return tl.where(c >= 8, -magnitude, magnitude)


@triton.jit
def _scales(scale_ptr, kb, rows, row_ok, k_hi, ss_n, ss_k, QBN: tl.constexpr, QBK: tl.constexpr, FORMAT: tl.constexpr):
    """[len(kb), BN] float32 scales of K blocks kb for weight rows `rows`."""
    mask = row_ok[None, :] & (kb[:, None] * QBK < k_hi)
    ptrs = scale_ptr + kb[:, None] * ss_k + (rows // QBN)[None, :] * ss_n
    if FORMAT == 1:
        scales = tl.load(ptrs, mask=mask, other=0.0)
    else:
        scales = e8m0_to_float(tl.load(ptrs, mask=mask, other=0))
    return scales


@triton.jit
def weight_tile(
    w_ptr, sw_n, sw_k, rows, n_hi, k, k_hi, scale_ptr, ss_n, ss_k, dtype: tl.constexpr, FORMAT: tl.constexpr,
    QBN: tl.constexpr, QBK: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """The [BK, BN] tile W[rows, k .. k + BK]^T of a weight W [N, K] in `dtype` (zeros past n_hi / k_hi).
    MXFP4: w_ptr points at the packed bytes [N, K / 2] (sw_n their row stride); scales [N, K / 32]."""
    row_ok = rows < n_hi
    # if / else all the way (no early return): Triton compiles the statements after a constexpr-true `return`
    if FORMAT == 3:
        half = k // 2 + tl.arange(0, BK // 2)
        packed = tl.load(w_ptr + rows[None, :].to(tl.int64) * sw_n + half[:, None], mask=row_ok[None, :] &
                         (half[:, None] < k_hi // 2), other=0)  # fmt: skip
        pairs = tl.join(e2m1_to_float(packed & 15), e2m1_to_float(packed >> 4))  # [BK / 2, BN, 2]: 2i, 2i + 1
        w = tl.reshape(tl.permute(pairs, (0, 2, 1)), (BK, BN))
        kb = k // QBK + tl.arange(0, BK // QBK)
        scales = _scales(scale_ptr, kb, rows, row_ok, k_hi, ss_n, ss_k, QBN, QBK, FORMAT)
        tile = tl.reshape(tl.reshape(w, (BK // QBK, QBK, BN)) * scales[:, None, :], (BK, BN)).to(dtype)
    else:
        ks = k + tl.arange(0, BK)
        w = tl.load(w_ptr + rows[None, :].to(tl.int64) * sw_n + ks[:, None] * sw_k,
                    mask=row_ok[None, :] & (ks[:, None] < k_hi), other=0.0)  # fmt: skip
        if FORMAT == 0:
            tile = w
        elif QBK >= BK:  # the tile lies in one K block: one scale a column
            scales = _scales(scale_ptr, k // QBK + tl.arange(0, 1), rows, row_ok, k_hi, ss_n, ss_k, QBN, QBK, FORMAT)
            tile = (w.to(tl.float32) * scales).to(dtype)
        else:
            kb = k // QBK + tl.arange(0, BK // QBK)
            scales = _scales(scale_ptr, kb, rows, row_ok, k_hi, ss_n, ss_k, QBN, QBK, FORMAT)
            blocks = tl.reshape(w.to(tl.float32), (BK // QBK, QBK, BN)) * scales[:, None, :]
            tile = tl.reshape(blocks, (BK, BN)).to(dtype)
    return tile


def scale_strides(args: WeightArgs, fallback: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(scale tensor, stride of its leading dim, of its rows, of its K blocks); a dense weight: `fallback`, 0s."""
    scales = args.scales
    if scales is None:
        return fallback, 0, 0, 0
    if scales.dim() == 2:
        return scales, 0, scales.stride(0), scales.stride(1)
    return scales, scales.stride(0), scales.stride(1), scales.stride(2)
