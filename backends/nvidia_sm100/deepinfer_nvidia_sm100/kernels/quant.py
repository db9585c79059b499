"""Weight tiles for the GEMM kernels, dense or quantized (ops.BlockFP8, ops.MXFP4), dequantized in registers.

A quantized tile is read as stored (FP8: one byte a value; MXFP4: two values a byte) with its scales and turned
into the MMA's dtype right before the MMA: Hopper has no FP4 MMA, and an FP8 MMA would need the activations in
FP8 too. The value is the reference's `dequantize()` exactly: element x scale in float32 (exact: e2m1 and e4m3
times a power of two, or e4m3 times a float32 scale rounded once), then rounded to the dtype.

Under Triton's interpreter and with float32 activations MXFP4 tiles never interleave the two nibbles of a byte back
into K order: the even K columns (low nibbles) and the odd ones (high nibbles) are two [BK/2, BN] tiles, each
multiplied with the matching columns of A (`a_tile`, `weight_mma`); the sum over K is the same products. Each
e2m1 code becomes an e4m3 byte by moving its bits (sign to bit 7, exponent and mantissa two places up: the
e4m3 value is the e2m1 value times 2^-6, e2m1's subnormal 0.5 landing on e4m3's subnormal 2^-7), which the
hardware converts; the 2^6 is given back once per output element (`finish`): power-of-two scalings are
exact, so the sums are the ones the dequantized weight gives (short of float32's subnormal range).

On the GPU with bf16 activations (chosen by `for_activations`):
- decode-sized (16-row) tiles: MXFP4_UPCAST. Four packed bytes at a time go through a few integer and bf16x2
  instructions (`mxfp4_upcast`, inline PTX: about 4 a value where Triton's own lowering spends several times
  that), then back into K order for one MMA. 1.2-1.4x faster than dot_scaled and than bf16 weights at 16-256
  decode rows on the H200 (bench/results/gpu_quant_kernels_nvidia_h200.json);
- other tiles: Triton's `tl.dot_scaled` (MXFP4_SCALED_DOT), which upcasts in its Hopper lowering; bit for bit the
  GEMM of the dequantized weight there.
Either tile holds the reference's dequantized values exactly (the upcast is checked against `dequantize` for every
byte and scale byte on the GPU: tests/backends/nvidia_gpu).

Formats (constexpr FORMAT): DENSE; FP8 (float32 scales); FP8_POW2 (E8M0 scale bytes); MXFP4 (E8M0 per 32 along
K: halves, dot_scaled or upcast). FP8 blocks may span whole K tiles (QBK a multiple of BK: one scale a column per
tile) or divide them (V4.1's 32: BK / QBK scales a column).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deepinfer_core.backend.weight_formats import MX_BLOCK, MXFP4, BlockFP8
from deepinfer_nvidia_sm100.kernels._common import INTERPRET, mma

__all__ = [
    "DENSE",
    "FP4_TILE_SCALE",
    "FP8",
    "FP8_POW2",
    "MXFP4_FORMAT",
    "MXFP4_FORMATS",
    "MXFP4_SCALED_DOT",
    "MXFP4_UPCAST",
    "WeightArgs",
    "a_tile",
    "check_tiles",
    "finish",
    "for_activations",
    "scale_strides",
    "weight_args",
    "weight_mma",
    "weight_tile",
]

DENSE, FP8, FP8_POW2, MXFP4_FORMAT, MXFP4_SCALED_DOT, MXFP4_UPCAST = 0, 1, 2, 3, 4, 5
MXFP4_FORMATS = (MXFP4_FORMAT, MXFP4_SCALED_DOT, MXFP4_UPCAST)
FP4_TILE_SCALE = 64.0  # an e2m1 code read as e4m3 is its value / 2^6: accumulators of MXFP4 tiles are x this
_TILE_SCALE = tl.constexpr(FP4_TILE_SCALE)
_MX = tl.constexpr(MX_BLOCK)


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
    if args.format in MXFP4_FORMATS and bk % qbk:
        raise ValueError(f"MXFP4 weights take K tiles of whole {qbk}-column scale blocks; the kernel's are {bk}")
    if args.format != DENSE and qbk % bk and bk % qbk:
        raise ValueError(f"quantization blocks of {qbk} columns neither span nor divide the kernel's {bk}-column tiles")


def for_activations(args: WeightArgs, dtype: torch.dtype, small: bool = False) -> WeightArgs:
    """The kernel format for these activations: MXFP4 with bf16 activations on the GPU -> MXFP4_UPCAST for `small`
    (16-row, decode-sized) tiles, else MXFP4_SCALED_DOT."""
    if args.format == MXFP4_FORMAT and dtype == torch.bfloat16 and not INTERPRET:
        return args._replace(format=MXFP4_UPCAST if small else MXFP4_SCALED_DOT)
    return args


@triton.jit
def e8m0_to_float(byte):
    """E8M0 bytes -> 2^(byte - 127) in float32: byte 0 is 2^-127 (a subnormal), 255 is NaN."""
    b = byte.to(tl.int32)
    bits = tl.where(b == 0, 0x00400000, tl.where(b == 255, 0x7FC00000, b << 23))
    return bits.to(tl.float32, bitcast=True)


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
    """The [BK, BN] tile W[rows, k .. k + BK]^T of a dense or FP8 weight W [N, K] in `dtype` (zeros past n_hi /
    k_hi); MXFP4 tiles come in two halves (`mxfp4_halves`)."""
    row_ok = rows < n_hi
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


@triton.jit
def mxfp4_halves(
    w_ptr, sw_n, rows, n_hi, k, k_hi, scale_ptr, ss_n, ss_k, dtype: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr
):  # fmt: skip
    """MXFP4 W[rows, k .. k + BK]^T / FP4_TILE_SCALE as two [BK / 2, BN] tiles in `dtype`: the even K columns
    (low nibbles) and the odd ones (high nibbles). BK is a multiple of the 32-column scale block."""
    row_ok = rows < n_hi
    half = k // 2 + tl.arange(0, BK // 2)
    packed = tl.load(w_ptr + rows[None, :].to(tl.int64) * sw_n + half[:, None], mask=row_ok[None, :] &
                     (half[:, None] < k_hi // 2), other=0)  # fmt: skip
    # e2m1 s.ee.m -> e4m3 s.0000.ee.m00 (its value / 2^6, subnormals included)
    even = (((packed & 7) << 2) | ((packed & 8) << 4)).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    odd = (((packed >> 2) & 0x1C) | (packed & 0x80)).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    # the scale of each half-column: its 32-column block, one of BK / 32 in the tile (a select, no reshape)
    block_of_half = tl.arange(0, BK // 2) // (_MX // 2)
    scale = tl.zeros((BK // 2, BN), dtype=tl.float32)
    for j in tl.static_range(BK // _MX):
        kb = k // _MX + j
        byte = tl.load(scale_ptr + kb * ss_k + rows * ss_n, mask=row_ok & (kb * _MX < k_hi), other=0)
        scale = tl.where((block_of_half == j)[:, None], e8m0_to_float(byte)[None, :], scale)
    return (even * scale).to(dtype), (odd * scale).to(dtype)


# 4 packed bytes (8 e2m1 codes) and their 4 E8M0 scale bytes -> the 4 low-nibble values ($0, $1: bf16 pairs) and
# the 4 high-nibble ones ($2, $3). Per pair of bytes: spread to 16-bit lanes (prmt), place each code's magnitude
# at bf16 bits 6-8 and its sign at 15 (the bf16 whose bits these are is the value x 2^-126, 0.5 a subnormal),
# x 2^126 and x the scale 2^(s - 127) (bits s << 7, 2^-127 for s = 0) in bf16x2 FMAs with -0: exact.
def _nibble_pair(shift_magnitude: int, shift_sign: int, out: str) -> str:
    """PTX: one nibble of each byte in t's two 16-bit lanes -> the bf16 pair of its values x the scales sc, in out."""
    return f"""shl.b32 x, t, {shift_magnitude};
and.b32 x, x, 0x01C001C0;
shl.b32 y, t, {shift_sign};
and.b32 y, y, 0x80008000;
or.b32 v, x, y;
fma.rn.bf16x2 v, v, c, nz;
fma.rn.bf16x2 {out}, v, sc, nz;
"""


def _byte_pair(selector: str, low_out: str, high_out: str) -> str:
    """PTX: bytes `selector` picks of $4 (codes) and $5 (scales) -> their low-nibble and high-nibble bf16 pairs."""
    return f"""prmt.b32 t, $4, z, {selector};
prmt.b32 s, $5, z, {selector};
shl.b32 sc, s, 7;
max.u16x2 sc, sc, lo;
{_nibble_pair(6, 12, low_out)}{_nibble_pair(2, 8, high_out)}"""


_UPCAST_ASM = tl.constexpr(
    """{
.reg .b32 z, c, nz, lo, t, s, sc, x, y, v;
mov.b32 z, 0;
mov.b32 lo, 0x00400040;
mov.b32 c, 0x7E807E80;
mov.b32 nz, 0x80008000;
"""
    + _byte_pair("0x4140", "$0", "$2")  # bytes 0, 1 -> lanes 0, 1
    + _byte_pair("0x4342", "$1", "$3")  # bytes 2, 3
    + "}"
)


@triton.jit
def _packed_tile(w_ptr, sw_n, rows, n_hi, k, k_hi, BK: tl.constexpr, BN: tl.constexpr):
    """The [BK / 2, BN] packed bytes of MXFP4 W[rows, k .. k + BK]^T (zeros past n_hi / k_hi)."""
    half = k // 2 + tl.arange(0, BK // 2)
    return tl.load(w_ptr + rows[None, :].to(tl.int64) * sw_n + half[:, None],
                   mask=(rows < n_hi)[None, :] & (half[:, None] < k_hi // 2), other=0)  # fmt: skip


@triton.jit
def mxfp4_upcast(packed, scale_bytes):
    """Packed e2m1 bytes and each byte's E8M0 scale byte -> (low-nibble values, high-nibble values) in bf16."""
    return tl.inline_asm_elementwise(
        _UPCAST_ASM, "=r,=r,=r,=r,r,r", [packed, scale_bytes], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4
    )


@triton.jit
def a_tile(a_rows, sa_k, rows_ok, k, k_hi, FORMAT: tl.constexpr, BK: tl.constexpr):
    """A[rows, k .. k + BK] as the weight's tiles pair with it (a_rows: [BM, 1] row pointers, rows_ok [BM, 1]):
    MXFP4: (its even columns, its odd columns), [BM, BK / 2] each; other formats: (the tile, the same tile)."""
    if FORMAT == 3:
        ks = k + 2 * tl.arange(0, BK // 2)
        a = tl.load(a_rows + ks[None, :] * sa_k, mask=rows_ok & (ks[None, :] < k_hi), other=0.0)
        a_odd = tl.load(a_rows + (ks[None, :] + 1) * sa_k, mask=rows_ok & (ks[None, :] + 1 < k_hi), other=0.0)
    else:
        ks = k + tl.arange(0, BK)
        a = tl.load(a_rows + ks[None, :] * sa_k, mask=rows_ok & (ks[None, :] < k_hi), other=0.0)
        a_odd = a
    return a, a_odd


@triton.jit
def weight_mma(
    acc, a, a_odd, w_ptr, sw_n, sw_k, rows, n_hi, k, k_hi, scale_ptr, ss_n, ss_k, F32: tl.constexpr,
    FORMAT: tl.constexpr, QBN: tl.constexpr, QBK: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """acc + A[:, k .. k + BK] @ W[rows, k .. k + BK]^T, A as `a_tile` gives it (MXFP4 halves: acc gathers the
    products / FP4_TILE_SCALE until `finish`; MXFP4_SCALED_DOT: Triton's dot_scaled, bf16 A; MXFP4_UPCAST: the
    tile upcast to bf16 by `mxfp4_upcast`, bf16 A)."""
    if FORMAT == 3:
        even, odd = mxfp4_halves(w_ptr, sw_n, rows, n_hi, k, k_hi, scale_ptr, ss_n, ss_k, a.dtype, BK, BN)
        acc = mma(a_odd, odd, mma(a, even, acc, F32), F32)
    elif FORMAT == 4:
        packed = _packed_tile(w_ptr, sw_n, rows, n_hi, k, k_hi, BK, BN)
        kb = k // _MX + tl.arange(0, BK // _MX)
        scales = tl.load(
            scale_ptr + rows[:, None] * ss_n + kb[None, :] * ss_k,
            mask=(rows < n_hi)[:, None] & (kb[None, :] * _MX < k_hi),
            other=127,
        )  # fmt: skip  [BN, BK / 32], E8M0 bytes
        acc = tl.dot_scaled(a, None, "bf16", packed, scales, "e2m1", acc)
    elif FORMAT == 5:
        packed = _packed_tile(w_ptr, sw_n, rows, n_hi, k, k_hi, BK, BN)
        kb = k // _MX + tl.arange(0, BK // _MX)
        scales = tl.load(
            scale_ptr + rows[None, :] * ss_n + kb[:, None] * ss_k,
            mask=(rows < n_hi)[None, :] & (kb[:, None] * _MX < k_hi),
            other=127,
        )  # fmt: skip  [BK / 32, BN], E8M0 bytes
        # each byte's scale: its block's, broadcast over the block's 16 bytes
        scales = tl.reshape(tl.broadcast_to(scales[:, None, :], (BK // _MX, _MX // 2, BN)), (BK // 2, BN))
        low, high = mxfp4_upcast(packed, scales)
        w = tl.reshape(tl.permute(tl.join(low, high), (0, 2, 1)), (BK, BN))  # back into K order: one MMA
        acc = mma(a, w, acc, F32)
    else:
        w = weight_tile(
            w_ptr, sw_n, sw_k, rows, n_hi, k, k_hi, scale_ptr, ss_n, ss_k, a.dtype, FORMAT, QBN, QBK, BK, BN
        )
        acc = mma(a, w, acc, F32)
    return acc


@triton.jit
def finish(acc, FORMAT: tl.constexpr):
    """An accumulator of `weight_mma` calls -> the GEMM's float32 result (MXFP4: x FP4_TILE_SCALE, exact).
    (if / else, never an early return: Triton compiles the statements after a constexpr-true `return`.)"""
    if FORMAT == 3:
        acc = acc * _TILE_SCALE
    return acc


def scale_strides(args: WeightArgs, fallback: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(scale tensor, stride of its leading dim, of its rows, of its K blocks); a dense weight: `fallback`, 0s."""
    scales = args.scales
    if scales is None:
        return fallback, 0, 0, 0
    if scales.dim() == 2:
        return scales, 0, scales.stride(0), scales.stride(1)
    return scales, scales.stride(0), scales.stride(1), scales.stride(2)
