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

__all__ = ["format_code", "load_rows"]

PLAIN, FP8_POW2, FP4_POW2, FP4_E4M3 = 0, 1, 2, 3
_CODES = dict(zip(BLOCK_FORMATS, (FP8_POW2, FP4_POW2, FP4_E4M3)))


def format_code(cache: torch.Tensor, spec: CacheSpec | None) -> int:
    """FMT for a kernel reading `cache`: its spec's stored format when the layout stored it packed (uint8)."""
    if spec is not None and spec.stored_format and cache.dtype == torch.uint8:
        return _CODES[spec.stored_format]
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
def _block_scales(base, mask, FMT: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
    """[BN, BD] float32: each element's block scale, from the row's D / block scale bytes after its codes,
    loaded as one contiguous [BN, BD / block] tile and widened."""
    BLOCK: tl.constexpr = 16 if FMT == 3 else 32
    CODES: tl.constexpr = D if FMT == 1 else D // 2
    b = tl.arange(0, BD // BLOCK)
    byte = tl.load(base + CODES + b[None, :], mask[:, None] & (b < D // BLOCK)[None, :], other=0).to(tl.int32)
    if FMT == 3:
        scale = _e4m3(byte)
    else:
        scale = (byte << 23).to(tl.float32, bitcast=True)
    return tl.reshape(tl.broadcast_to(scale[:, :, None], (scale.shape[0], BD // BLOCK, BLOCK)), (scale.shape[0], BD))


@triton.jit
def load_rows(ptr, rows, stride, mask, d, in_d, FMT: tl.constexpr, D: tl.constexpr):
    """Entries [BN, BD] at `rows` [BN] (int64) of a row-per-slot cache, 0 where not `mask`: the row's elements
    as stored (FMT 0, the cache's dtype) or decoded from its packed bytes (float32). Every load is a contiguous
    tile (codes, then scales), widened in registers."""
    base = ptr + rows[:, None] * stride
    if FMT == 0:
        return tl.load(base + d[None, :], mask[:, None] & in_d[None, :], other=0.0)
    else:
        BD: tl.constexpr = d.shape[0]
        scale = _block_scales(base, mask, FMT, D, BD)
        if FMT == 1:  # fp8_e4m3/pow2:32: D code bytes
            q = _e4m3(tl.load(base + d[None, :], mask[:, None] & in_d[None, :], other=0).to(tl.int32))
        else:  # FP4: D / 2 code bytes, element 2i in the low nibble, 2i + 1 in the high one
            h = tl.arange(0, BD // 2)
            byte = tl.load(base + h[None, :], mask[:, None] & (h < D // 2)[None, :], other=0).to(tl.int32)
            q = tl.reshape(tl.join(_e2m1(byte & 0xF), _e2m1(byte >> 4)), (byte.shape[0], BD))
        return q * scale
