"""Reading caches stored packed (deepinfer_core.kv.packed.PackedKVLayout, the byte layout of kv.formats) inside
the attention and indexer kernels: each row's element codes and block scales are loaded as bytes and decoded in
registers, by integer arithmetic (exact, and the same under Triton's interpreter), into the float32 values
element x scale that kv.formats.unpack gives; cast to the cache's dtype, they are its canonical entries.

A kernel takes the format as the constexpr FMT (`format_code`): 0 a plain row of the cache's dtype, else one of
kv.formats.BLOCK_FORMATS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.kv.formats import BLOCK_FORMATS
from deepinfer_core.kv.layout import CacheSpec
from deepinfer_nvidia_sm100.kernels._common import INTERPRET

__all__ = ["format_code", "load_rows"]

PLAIN, FP8_POW2, FP4_POW2, FP4_E4M3, FP8_POW2_CVT = 0, 1, 2, 3, 4
_CODES = dict(zip(BLOCK_FORMATS, (FP8_POW2, FP4_POW2, FP4_E4M3)))


def format_code(cache: torch.Tensor, spec: CacheSpec | None) -> int:
    """FMT for a kernel reading `cache`: its spec's stored format when the layout stored it packed (uint8). On a
    GPU the e4m3 elements take the hardware's float8 conversion (FP8_POW2_CVT: exact, like the integer decode
    the interpreter runs, which has no float8)."""
    if spec is not None and spec.stored_format and cache.dtype == torch.uint8:
        code = _CODES[spec.stored_format]
        return FP8_POW2_CVT if code == FP8_POW2 and not INTERPRET else code
    return PLAIN


@triton.jit
def _e4m3(byte):
    """float8 e4m3fn byte (int32 0..255) -> float32: normal (e + 120) << 23 | m << 20, subnormal m x 2^-9."""
    e = (byte >> 3) & 0xF
    m = byte & 7
    magnitude = tl.where(
        e == 0, m.to(tl.float32) * 0.001953125, ((e + 120) << 23 | m << 20).to(tl.float32, bitcast=True)
    )
    magnitude = tl.where((byte & 0x7F) == 0x7F, float("nan"), magnitude)
    return tl.where(byte >= 128, -magnitude, magnitude)


@triton.jit
def _e2m1(nibble):
    """FP4 e2m1 code (int32 0..15: sign bit, then the magnitude's index) -> float32."""
    i = (nibble & 7).to(tl.float32)
    magnitude = tl.where(i < 4, i * 0.5, tl.where(i < 7, i - 2.0, 6.0))
    return tl.where(nibble >= 8, -magnitude, magnitude)


@triton.jit
def load_rows(ptr, rows, stride, mask, d, in_d, FMT: tl.constexpr, D: tl.constexpr):
    """Entries [BN, BD] at `rows` [BN] (int64) of a row-per-slot cache, 0 where not `mask`: the row's elements
    as stored (FMT 0, the cache's dtype) or decoded from its packed bytes (float32): each element's code byte and
    block scale byte are loaded where it is (no reshapes: their layout conversions misalign on Hopper)."""
    tile = mask[:, None] & in_d[None, :]
    base = ptr + rows[:, None] * stride
    if FMT == 0:
        return tl.load(base + d[None, :], tile, other=0.0)
    elif FMT == 1 or FMT == 4:  # fp8_e4m3/pow2:32: D code bytes, then an e8m0 byte per 32
        codes = tl.load(base + d[None, :], tile, other=0)
        if FMT == 4:
            q = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            q = _e4m3(codes.to(tl.int32))
        scale = (tl.load(base + D + d[None, :] // 32, tile, other=0).to(tl.int32) << 23).to(tl.float32, bitcast=True)
        return q * scale
    else:  # FP4: D / 2 code bytes (element 2i low nibble, 2i + 1 high), then a scale byte per 32 (e8m0) or 16 (e4m3)
        byte = tl.load(base + d[None, :] // 2, tile, other=0).to(tl.int32)
        q = _e2m1((byte >> ((d[None, :] % 2) * 4)) & 0xF)
        if FMT == 2:
            scale_byte = tl.load(base + D // 2 + d[None, :] // 32, tile, other=0).to(tl.int32)
            scale = (scale_byte << 23).to(tl.float32, bitcast=True)
        else:
            scale = _e4m3(tl.load(base + D // 2 + d[None, :] // 16, tile, other=0).to(tl.int32))
        return q * scale
