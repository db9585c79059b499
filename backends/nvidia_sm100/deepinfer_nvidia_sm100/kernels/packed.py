"""Reading caches stored packed (deepinfer_core.kv.packed.PackedKVLayout, the byte layout of kv.formats) inside
the attention and indexer kernels: each row's element codes and block scales are loaded as bytes and decoded in
registers, by integer arithmetic (exact, and the same under Triton's interpreter), into the float32 values
element x scale that kv.formats.unpack gives; cast to the cache's dtype, they are its canonical entries.

A kernel takes the format as the constexpr FMT (`format_code`): 0 a plain row of the cache's dtype, else one of
kv.formats.BLOCK_FORMATS.

Staging. A kernel whose programs share rows (the attention's head blocks, a prefill's queries of one sequence)
would decode each row once per program; `stage_ring` and `stage_blocks` decode the rows a step can read once,
into a plain scratch tensor of the compute dtype, and hand back the slots / block table that address it. The
values are the ones the in-register decode gives, cast to the same dtype (under the interpreter a kernel reading
the scratch computes the same bits as one decoding the packed rows; compiled, the last bit may differ).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.kv.formats import BLOCK_FORMATS
from deepinfer_core.kv.layout import CacheSpec
from deepinfer_nvidia_sm100.kernels._common import INTERPRET, next_pow2

__all__ = ["STAGE_MAX_BYTES", "format_code", "load_rows", "stage_blocks", "stage_ring", "staged_bytes"]

PLAIN, FP8_POW2, FP4_POW2, FP4_E4M3, FP8_POW2_CVT = 0, 1, 2, 3, 4
# the largest scratch a choice by shapes stages blocks into (a long context's chunk would decode every entry of
# its sequence: 1 GiB at a million tokens of V4.1's ratio-1 entries); past it the kernels decode in registers
STAGE_MAX_BYTES = 256 << 20
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


@triton.jit
def _unpack_rows_kernel(src_ptr, rows_ptr, dst_ptr, n, ssrc, sdst, FMT: tl.constexpr, D: tl.constexpr,
                        BD: tl.constexpr, BLOCK_R: tl.constexpr):  # fmt: skip
    """dst[i] = the entry at row rows[i] of src, decoded (FMT) and cast to dst's dtype; untouched where rows[i] < 0."""
    i = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BD)
    in_d = d < D
    rows = tl.load(rows_ptr + i, mask=i < n, other=-1)
    live = rows >= 0
    rows = tl.maximum(rows, 0)
    values = load_rows(src_ptr, rows, ssrc, live, d, in_d, FMT, D)
    out = dst_ptr + i.to(tl.int64)[:, None] * sdst + d[None, :]
    tl.store(out, values.to(dst_ptr.dtype.element_ty), mask=live[:, None] & in_d[None, :])


def unpack_rows(cache: torch.Tensor, spec: CacheSpec, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The entries at `rows` [n] (int64 rows of `cache`, or -1: left unwritten) of packed `cache`, decoded ->
    [n, head_dim] of `dtype`."""
    dim = spec.head_dim
    out = torch.empty((rows.numel(), dim), dtype=dtype, device=cache.device)
    if rows.numel() == 0:
        return out
    block_d = max(16, next_pow2(dim))
    block_r = max(1, min(64, 8192 // block_d))
    launch = {} if INTERPRET else {"num_warps": 4}
    _unpack_rows_kernel[(triton.cdiv(rows.numel(), block_r),)](
        cache, rows, out, rows.numel(), cache.stride(0), out.stride(0),
        FMT=format_code(cache, spec), D=dim, BD=block_d, BLOCK_R=block_r, **launch,
    )  # fmt: skip
    return out


def stage_ring(ring: torch.Tensor, spec: CacheSpec, seq_slots: torch.Tensor, dtype: torch.dtype):
    """(scratch [B x ring_size, D], slots [B]): every ring row of the step's B sequences decoded, sequence b's
    ring at slot b of the scratch."""
    ring_size = spec.ring_size
    offsets = torch.arange(ring_size, device=ring.device)
    rows = (seq_slots.long()[:, None] * ring_size + offsets).flatten()
    return unpack_rows(ring, spec, rows, dtype), torch.arange(seq_slots.shape[0], device=ring.device)


def staged_bytes(spec: CacheSpec, tables: torch.Tensor, per_block: int, dtype: torch.dtype) -> int:
    """The scratch stage_blocks would fill for block tables `tables`: known on the host, from shapes alone."""
    return tables.numel() * per_block * spec.head_dim * dtype.itemsize


def stage_blocks(cache: torch.Tensor, spec: CacheSpec, tables: torch.Tensor, per_block: int, dtype: torch.dtype):
    """(scratch [B x W x per_block, D], tables [B, W]): the entries of every block in the step's block tables
    [B, W] decoded, block (b, w) at block b x W + w of the scratch; -1 stays -1 (nothing decoded there)."""
    batch, width = tables.shape
    offsets = torch.arange(per_block, device=cache.device)
    rows = torch.where(tables[:, :, None] >= 0, tables.long()[:, :, None] * per_block + offsets, -1).flatten()
    staged = torch.arange(batch * width, device=cache.device).view(batch, width)
    return unpack_rows(cache, spec, rows, dtype), torch.where(tables >= 0, staged, -1)
