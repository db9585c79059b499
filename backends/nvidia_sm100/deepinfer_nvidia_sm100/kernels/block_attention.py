"""DeepSeek-V4.1's DSpark draft attention (block_attention) in Triton: no host reads, so a CUDA graph captures it.

Every query of a sequence's block sees the same keys: the ring entries at positions since .. first - 1, since =
max(first - window, window_start, 0), then the block's own rows first .. last (all of them: the block attends to
itself in both directions). That is the window walk of kernels.sparse_attention with the query's position replaced
by the block's last, so this kernel reuses its pieces: one program per (query, head block) starts from the head's
sink (running max = the sink logit), folds splits of SPLIT_KEYS keys from `since` on, each an online softmax over
tiles of ring rows (before `first`) and step rows (from `first` on), and stores acc / denominator. A packed ring
(V4.1's FP8 window) is staged first, as sparse_attention stages it.

Batch invariance: a query's splits, the keys in each, their order and the fold are functions of its block's
since / first / last, SPLIT_KEYS and the tiles (constants, or functions of the head dim), never of the number of
tokens or sequences, so a row's bits do not depend on the rest of the step. Rows past query_start_loc[-1]
(padding) see no key: their output is 0 (the sink's state has no value).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.backend.ops import AttentionMetadata
from deepinfer_core.kv.layout import CacheSpec
from deepinfer_nvidia_sm100.kernels._common import INTERPRET, dot_in_float32, next_pow2
from deepinfer_nvidia_sm100.kernels.packed import format_code, stage_ring
from deepinfer_nvidia_sm100.kernels.sparse_attention import (
    LOG2E,
    SPLIT_KEYS,
    _query_heads,
    _sink_state,
    _store_out,
    _window,
)

__all__ = ["block_attention", "block_metadata"]


@triton.jit
def _block_attention_kernel(
    q_ptr, kv_ptr, ring_ptr, sinks_ptr, out_ptr, tok_ptr, seq_slots_ptr, H, T, scale_log2,
    sq_t, sq_h, skv, sring, so_t, so_h,
    D: tl.constexpr, BD: tl.constexpr, RING: tl.constexpr, SPLIT: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, F32: tl.constexpr,
):  # fmt: skip
    t, head_block = tl.program_id(0), tl.program_id(1)
    seq = tl.load(tok_ptr + t)  # tok [5, T]: sequence, first key position, block's first position and row, last
    since = tl.load(tok_ptr + T + t)
    first = tl.load(tok_ptr + 2 * T + t)
    row0 = tl.load(tok_ptr + 3 * T + t)
    last = tl.load(tok_ptr + 4 * T + t)
    heads, live, d, in_d, q = _query_heads(q_ptr, t, head_block, H, sq_t, sq_h, D, BD, BLOCK_H)
    m, denom, acc = _sink_state(sinks_ptr, heads, live, BD)
    ring_base = tl.load(seq_slots_ptr + seq) * RING
    m, denom, acc = _window(
        q, m, denom, acc, kv_ptr, ring_ptr, skv, sring, ring_base, since, last, first, row0, d, in_d, scale_log2,
        RING, SPLIT, BLOCK_N, F32,
    )  # fmt: skip
    _store_out(out_ptr, t, heads, d, live[:, None] & in_d[None, :], denom, acc, so_t, so_h)


def block_metadata(meta: AttentionMetadata, tokens: int, window: int) -> torch.Tensor:
    """[5, T] int32 on the device: each row's sequence, first key position (since), its block's first position and
    first row, and its block's last position; padding rows (past query_start_loc[-1]) get no keys (last < since)."""
    starts, seqs = meta.query_start_loc, meta.seq_lens.shape[0]
    t = torch.arange(tokens, device=starts.device)
    seq = torch.searchsorted(starts[1:], t, right=True)
    real = seq < seqs
    seq = seq.clamp(max=seqs - 1)
    row0, end = starts[seq], meta.seq_lens[seq]
    first = end - (starts[seq + 1] - row0)
    since = torch.maximum(first - window, meta.window_starts[seq].clamp(min=0))
    since, last = torch.where(real, since, 0), torch.where(real, end - 1, -1)
    return torch.stack([seq, since, first, row0, last]).to(torch.int32)


def block_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    ring: torch.Tensor,
    ring_spec: CacheSpec,
    meta: AttentionMetadata,
    *,
    sinks: torch.Tensor,
    scale: float,
    split_keys: int = SPLIT_KEYS,
) -> torch.Tensor:
    """q [T, H, D], kv [T, D], ring [rows, 1, D] of q's dtype or packed [rows, bytes] where its spec has a
    stored_format -> [T, H, D] in q.dtype (AttentionOps.block_attention). split_keys: keys per split (a power of
    two; it sets the rounding, so it is fixed in production)."""
    tokens, heads, dim = q.shape
    out = torch.empty((tokens, heads, dim), dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    if split_keys < 1 or split_keys & (split_keys - 1):
        raise ValueError(f"split_keys must be a power of two, got {split_keys}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    seq_slots = meta.seq_slots
    if format_code(ring, ring_spec):
        ring, seq_slots = stage_ring(ring, ring_spec, seq_slots, q.dtype)
    if kv.stride(-1) != 1 or kv.dtype != ring.dtype:  # a tile reads ring and step rows with one load
        kv = kv.to(ring.dtype).contiguous()
    block_d = max(16, next_pow2(dim))
    block_h = min(max(16, next_pow2(heads)), 64)  # as sparse_attention: each key tile serves up to 64 heads
    launch = {} if INTERPRET else {"num_warps": 4 if block_d < 256 else 8, "num_stages": 2}
    block_n = min(split_keys, 16 if INTERPRET else (32 if block_d >= 256 else 64))
    _block_attention_kernel[(tokens, triton.cdiv(heads, block_h))](
        q, kv, ring, sinks, out, block_metadata(meta, tokens, ring_spec.window), seq_slots, heads, tokens,
        scale * LOG2E, q.stride(0), q.stride(1), kv.stride(0), ring.stride(0), out.stride(0), out.stride(1),
        D=dim, BD=block_d, RING=ring_spec.ring_size, SPLIT=split_keys, BLOCK_H=block_h, BLOCK_N=block_n,
        F32=dot_in_float32(q.dtype), **launch,
    )  # fmt: skip
    return out
