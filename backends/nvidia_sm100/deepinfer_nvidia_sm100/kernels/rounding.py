"""DeepSeek-V4.1's fake quantisation, `round_to_format`, in one launch where the reference takes a dozen; and
`pack_rows`, the same rounding stored as kv.formats' bytes into a packed cache's rows (PackedKVLayout.write's
bytes, in one launch instead of some forty torch ops).

Each block of the last dim takes the value it has in a block format of BLOCK_FORMATS, bitwise the reference's:
the same IEEE float32 operations in the same order (divisions correctly rounded: `div_rn`, never the
approximate `/`; no multiply feeds an add, so none is contracted into an FMA), and the float8 e4m3 and FP4 e2m1
roundings in integer and compare arithmetic, which every GPU and Triton's interpreter do alike (a float8 cast
would differ between them). Row-local: each block is rounded from its own values only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.backend.ops import block_length
from deepinfer_nvidia_sm100.kernels._common import next_pow2

# the kernel's FORMAT constexpr, by format: 0 fp8 e4m3 / pow2 scale, 1 fp4 e2m1 / pow2 scale, 2 fp4 / e4m3 scale
FORMATS = {"fp8_e4m3/pow2:32": 0, "fp4_e2m1/pow2:32": 1, "fp4_e2m1/e4m3:16": 2}


@triton.jit
def _pow2ceil(t):
    """2^(e - 127 + (m != 0)) from the float32 bits of t >= 0: the reference's _pow2ceil, bit for bit (a NaN t
    gives -0.0 there too: the exponent 256 wraps into the sign bit)."""
    bits = t.to(tl.int32, bitcast=True)
    power = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return ((power + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(x):
    """float32 x rounded to float8 e4m3fn (to nearest, ties to even) and back, as torch casts: magnitudes
    past 448 saturate to 448 (torch >= 2.12, and the GPU's cvt.satfinite), NaN stays NaN, the sign is kept."""
    bits = x.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    exponent = magnitude >> 23  # biased; 0 for float32 subnormals, which have no leading one
    mantissa = (magnitude & 0x7FFFFF) | tl.where(exponent > 0, 0x800000, 0)  # |x| = mantissa 2^(exponent - 150)
    exponent = tl.maximum(exponent, 1)
    quantum = tl.maximum(exponent, 121)  # e4m3 keeps 3 bits below the leading one, none below 2^-9 (2^-6 - 3)
    shift = tl.minimum(20 + quantum - exponent, 25)  # mantissa < 2^24: any shift from 25 on leaves 0
    q = mantissa >> shift
    rest = mantissa & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    q += ((rest > half) | ((rest == half) & ((q & 1) == 1))).to(tl.int32)  # to nearest, ties to even
    value = q.to(tl.float32) * ((quantum - 3) << 23).to(tl.float32, bitcast=True)  # q 2^(quantum - 130), exact
    value = tl.where(x != x, x, tl.where(value > 448.0, 448.0, value))
    # x's sign bit on the magnitude (a negation would make -0.0 of 0.0 - 0.0, which is +0.0)
    return (value.to(tl.int32, bitcast=True) | (bits ^ magnitude)).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1(q):
    """q in [-6, 6] to the nearest FP4 e2m1 value, ties to the even code, a zero result +0 (and NaN to +0): the
    reference's _round_e2m1, by the same comparisons."""
    a = tl.abs(q)
    code = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    code += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    magnitude = tl.where(code < 4, code * 0.5, tl.where(code < 7, code - 2.0, 6.0))
    return tl.where((q < 0) & (magnitude > 0), -magnitude, magnitude)


@triton.jit
def _clamp(x, low, high):
    """torch.clamp(x, low, high): NaN stays NaN."""
    return tl.minimum(_at_least(x, low), high, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _at_least(x, low):
    """torch.clamp_min(x, low): NaN stays NaN."""
    return tl.maximum(x, low, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _round_kernel(x_ptr, out_ptr, L, sx_r, FORMAT: tl.constexpr, B: tl.constexpr, G: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = (tl.program_id(1) * G + tl.arange(0, G))[:, None] * B + tl.arange(0, B)[None, :]  # [G blocks, B]
    mask = cols < L  # L is whole blocks
    x = tl.load(x_ptr + r * sx_r + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    amax = tl.where(tl.max((x != x).to(tl.int32), axis=1) > 0, float("nan"), amax)[:, None]  # torch's amax keeps a NaN
    if FORMAT == 0:
        scale = _pow2ceil(_at_least(amax, 1e-4) * (1 / 448))
        q = _e4m3(_clamp(tl.math.div_rn(x, scale), -448.0, 448.0))
    elif FORMAT == 1:
        scale = _pow2ceil(_at_least(amax, 6 * 2**-126) * (1 / 6))
        q = _e2m1(_clamp(tl.math.div_rn(x, scale), -6.0, 6.0))
    else:  # the scale a correctly rounded division by 6, then rounded to e4m3
        scale = _e4m3(tl.math.div_rn(_at_least(amax, 6 * 2**-9), tl.full([G, 1], 6.0, tl.float32)))
        q = _e2m1(_clamp(tl.math.div_rn(x, scale), -6.0, 6.0))
    tl.store(out_ptr + r * L + cols, (q * scale).to(out_ptr.dtype.element_ty), mask=mask)


def round_to_format(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [..., L] -> the value each block of L takes in block format `fmt` (see V41Ops.round_to_format), x's
    shape and dtype; ValueError for an unknown format or an L the block does not divide."""
    block = block_length(fmt, x)
    rows = x.reshape(-1, x.shape[-1])  # [R, L]
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    blocks = rows.shape[1] // block
    group = min(next_pow2(blocks), 1024 // block)  # blocks per program
    if rows.numel():
        _round_kernel[(rows.shape[0], triton.cdiv(blocks, group))](
            rows, out, rows.shape[1], rows.stride(0), FORMAT=FORMATS[fmt], B=block, G=group
        )
    return out.view(x.shape)


@triton.jit
def _e4m3_code(v):
    """The float8 e4m3fn byte (int32) of v, a float32 already in e4m3: sign bit, then 2^-9 multiples below 2^-6,
    else the biased exponent and 3 mantissa bits."""
    bits = v.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    normal = ((magnitude >> 23) - 120) << 3 | ((magnitude >> 20) & 7)
    code = tl.where(magnitude < (121 << 23), (tl.abs(v) * 512.0).to(tl.int32), normal)
    return code | ((bits >> 24) & 0x80)


@triton.jit
def _e2m1_code(q):
    """The FP4 nibble (int32) of q, already e2m1 with +0 for zero: the sign bit, then the magnitude's index."""
    a = tl.abs(q)
    index = tl.where(a <= 2.0, a * 2.0, tl.where(a <= 4.0, a + 2.0, 7.0)).to(tl.int32)
    return index | tl.where(q < 0, 8, 0)


@triton.jit
def _holds(x, scale):
    """[G]: whether each block of x [G, B] is exactly e2m1 elements times its scale [G, 1]."""
    q = _e2m1(_clamp(tl.math.div_rn(x, scale), -6.0, 6.0))
    return tl.min((q * scale == x).to(tl.int32), axis=1) > 0


@triton.jit
def _pack_kernel(
    x_ptr, slots_ptr, cache_ptr, L, sx_r, s_cache,
    FORMAT: tl.constexpr, B: tl.constexpr, G: tl.constexpr, CODE_BYTES: tl.constexpr,
):  # fmt: skip
    """Row r of x, G blocks of it per program, into cache row slots[r]: codes, then scale bytes (kv.formats)."""
    r = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1) * G + tl.arange(0, G)  # [G]
    cols = block[:, None] * B + tl.arange(0, B)[None, :]  # [G, B]
    mask = cols < L  # L is whole blocks
    x = tl.load(x_ptr + r * sx_r + cols, mask=mask, other=0.0).to(tl.float32)
    row = cache_ptr + tl.load(slots_ptr + r).to(tl.int64) * s_cache
    amax = tl.max(tl.abs(x), axis=1)[:, None]
    if FORMAT == 0:
        scale = _pow2ceil(_at_least(amax, 1e-4) * (1 / 448))
        q = _e4m3(_clamp(tl.math.div_rn(x, scale), -448.0, 448.0))
        tl.store(row + cols, _e4m3_code(q).to(tl.uint8), mask=mask)
    else:
        if FORMAT == 1:
            scale = _pow2ceil(_at_least(amax, 6 * 2**-126) * (1 / 6))
        else:  # as round_to_format, unless amax / 4 holds a block the rule's scale does not (kv.formats.pack)
            scale = _e4m3(tl.math.div_rn(_at_least(amax, 6 * 2**-9), tl.full([G, 1], 6.0, tl.float32)))
            quarter = amax * 0.25
            quarter_fits = _holds(x, quarter) & (tl.reshape(_e4m3(quarter) == quarter, [G]))
            scale = tl.where((quarter_fits & ~_holds(x, scale))[:, None], quarter, scale)
        nibbles = _e2m1_code(_e2m1(_clamp(tl.math.div_rn(x, scale), -6.0, 6.0)))
        pairs = tl.reshape(nibbles * tl.where(cols % 2 == 0, 1, 16), [G, B // 2, 2])  # element 2i low, 2i + 1 high
        half = block[:, None] * (B // 2) + tl.arange(0, B // 2)[None, :]
        tl.store(row + half, tl.sum(pairs, axis=2).to(tl.uint8), mask=half < L // 2)
    if FORMAT == 2:
        scale_bytes = _e4m3_code(scale)
    else:
        scale_bytes = (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF  # e8m0: the exponent field
    tl.store(row + CODE_BYTES + block, tl.reshape(scale_bytes, [G]).to(tl.uint8), mask=block * B < L)


def pack_rows(values: torch.Tensor, fmt: str, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """values [N, ..., L] -> packed into cache rows `slots` [N] of `cache` [rows, row bytes] uint8, as
    kv.formats.pack (bit for bit), in place."""
    rows = values.flatten(1)  # not reshape(N, -1), which N = 0 makes ambiguous
    if slots.shape != (rows.shape[0],):
        raise ValueError(f"pack_rows: {rows.shape[0]} rows of values for slots of shape {tuple(slots.shape)}")
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    block = block_length(fmt, rows)
    blocks = rows.shape[1] // block
    group = min(next_pow2(blocks), 1024 // block)
    if rows.shape[0]:
        _pack_kernel[(rows.shape[0], triton.cdiv(blocks, group))](
            rows, slots, cache, rows.shape[1], rows.stride(0), cache.stride(0),
            FORMAT=FORMATS[fmt], B=block, G=group, CODE_BYTES=rows.shape[1] * (8 if FORMATS[fmt] == 0 else 4) // 8,
        )  # fmt: skip
