"""DeepSeek-V4's sparse attention (one shared key = value head): sliding window, compressed entries and sinks.

One program serves one query token for BLOCK_H of its H heads: the heads share the single key = value head,
so each loaded entry tile [BLOCK_N, D] is multiplied by all of them (q [BLOCK_H, D] x K^T), and serves as
the values of the same tile. The online softmax (float32, log2 domain) starts from the head's sink logit
(running max = sink, denominator = 1, no value), then visits
  (a) the window: positions max(t - window + 1, min(window_start, first)) .. t, read from the sequence's ring
      (row `seq_slot * ring_size + p % ring_size`) for positions before the step's first token `first`, and
      from this step's `kv` rows for the others (ring entries before `window_start` are never read);
  (b) compressed entries w < (t + 1) // m: all of them, or those listed in the query's `indices` row, sorted
      on the device beforehand so a repeated entry is skipped by comparing with its left neighbour.
The caches are ReferenceKVLayout's row-per-slot tensors [rows, 1, D] (the nvidia_sm100 layout). A query's
result depends only on its own row and metadata, never on the batch around it.

Per-token metadata (sequence, position, first step position, first kv row) is built with torch ops on the
device: no host reads, nothing shaped by the batch's contents.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia_sm100.kernels._common import INTERPRET, dot_in_float32, mma, next_pow2

__all__ = ["sparse_attention"]

LOG2E = 1.4426950408889634


@triton.jit
def _attend(q, keys, visible, m, denom, acc, scale_log2, F32: tl.constexpr):
    """One online-softmax step of q [BH, BD] over keys [BN, BD] (= values), `visible` [BN] or [BH, BN]."""
    scores = mma(q, tl.trans(keys), tl.zeros((q.shape[0], keys.shape[0]), dtype=tl.float32), F32) * scale_log2
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet (a -inf sink): stay at 0
    p = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(m - m_safe)
    denom = denom * alpha + tl.sum(p, axis=1)
    acc = mma(p.to(keys.dtype), keys, acc * alpha[:, None], F32)
    return m_new, denom, acc


@triton.jit
def _rows(ptr, rows, stride, mask, d, in_d):
    """Entries [BN, BD] at `rows` [BN] (int64) of a row-per-slot tensor, 0 where not `mask`."""
    return tl.load(ptr + rows[:, None] * stride + d[None, :], mask[:, None] & in_d[None, :], other=0.0)


@triton.jit
def _sparse_attention_kernel(
    q_ptr, kv_ptr, ring_ptr, comp_ptr, idx_ptr, sinks_ptr, out_ptr, tok_ptr,
    seq_slots_ptr, window_starts_ptr, tables_ptr, H, T, K, scale_log2,
    sq_t, sq_h, skv, sring, scomp, sidx, so_t, so_h, st_b,
    D: tl.constexpr, BD: tl.constexpr, WINDOW: tl.constexpr, RING: tl.constexpr, RATE: tl.constexpr,
    PER_BLOCK: tl.constexpr, COMPRESSED: tl.constexpr, INDEXED: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, F32: tl.constexpr,
):  # fmt: skip
    t, head_block = tl.program_id(0), tl.program_id(1)
    seq = tl.load(tok_ptr + t)  # tok [4, T]: sequence, position, first step position, first step row
    pos = tl.load(tok_ptr + T + t)
    first = tl.load(tok_ptr + 2 * T + t)
    row0 = tl.load(tok_ptr + 3 * T + t)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    live = heads < H
    d = tl.arange(0, BD)
    in_d = d < D
    q = _rows(q_ptr + t.to(tl.int64) * sq_t, heads.to(tl.int64), sq_h, live, d, in_d)  # [BLOCK_H, BD]

    m = tl.load(sinks_ptr + heads, mask=live, other=0.0).to(tl.float32) * 1.4426950408889634  # the sink logit
    denom = tl.where(m == float("-inf"), 0.0, 1.0)  # exp2(sink - m) = 1, and it carries no value
    acc = tl.zeros((BLOCK_H, BD), dtype=tl.float32)

    # (a) the window: ring entries before `first` (from the window start on), this step's rows from `first`
    ring_base = tl.load(seq_slots_ptr + seq) * RING
    since = tl.maximum(pos - (WINDOW - 1), tl.minimum(tl.load(window_starts_ptr + seq), first))
    for start in range(since, pos + 1, BLOCK_N):
        p = start + tl.arange(0, BLOCK_N)
        in_ring = p < first
        in_step = (p >= first) & (p <= pos)
        ring_rows = (ring_base + p % RING).to(tl.int64)
        from_ring = _rows(ring_ptr, ring_rows, sring, in_ring, d, in_d)
        step_rows = (row0 + p - first).to(tl.int64)
        from_step = _rows(kv_ptr, step_rows, skv, in_step, d, in_d)
        keys = tl.where(in_ring[:, None], from_ring, from_step.to(from_ring.dtype))
        m, denom, acc = _attend(q, keys, (in_ring | in_step)[None, :], m, denom, acc, scale_log2, F32)

    # (b) the compressed entries this query sees: all of them, or the listed ones
    if COMPRESSED:
        visible = (pos + 1) // RATE
        table = tables_ptr + seq.to(tl.int64) * st_b
        if INDEXED:
            row = idx_ptr + t.to(tl.int64) * sidx
            for start in range(0, K, BLOCK_N):
                k = start + tl.arange(0, BLOCK_N)
                w = tl.load(row + k, mask=k < K, other=-1)
                before = tl.load(row + k - 1, mask=(k > 0) & (k < K), other=-1)  # sorted: a repeat follows its twin
                chosen = (w >= 0) & (w < visible) & ((w != before) | (k == 0))
                block_id = tl.load(table + w // PER_BLOCK, mask=chosen, other=0)
                rows = (block_id * PER_BLOCK + w % PER_BLOCK).to(tl.int64)
                keys = _rows(comp_ptr, rows, scomp, chosen, d, in_d)
                m, denom, acc = _attend(q, keys.to(q.dtype), chosen[None, :], m, denom, acc, scale_log2, F32)
        else:
            for start in range(0, visible, BLOCK_N):
                w = start + tl.arange(0, BLOCK_N)
                chosen = w < visible
                block_id = tl.load(table + w // PER_BLOCK, mask=chosen, other=0)
                rows = (block_id * PER_BLOCK + w % PER_BLOCK).to(tl.int64)
                keys = _rows(comp_ptr, rows, scomp, chosen, d, in_d)
                m, denom, acc = _attend(q, keys.to(q.dtype), chosen[None, :], m, denom, acc, scale_log2, F32)

    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    out_rows = out_ptr + t.to(tl.int64) * so_t + heads[:, None] * so_h
    tl.store(out_rows + d[None, :], out.to(out_ptr.dtype.element_ty), mask=live[:, None] & in_d[None, :])


def token_metadata(meta, tokens: int) -> torch.Tensor:
    """[4, T] int32 on the device: each query's sequence, position, its step's first position and first row."""
    starts = meta.query_start_loc
    t = torch.arange(tokens, device=starts.device)
    seq = torch.searchsorted(starts[1:], t, right=True)  # the sequence whose rows hold t
    row0 = starts[seq]
    first = meta.seq_lens[seq] - (starts[seq + 1] - row0)
    return torch.stack([seq, first + t - row0, first, row0]).to(torch.int32)


def sparse_attention(
    q, kv, ring, ring_spec, meta, block_size: int, *, sinks, scale: float, compressed=None, compressed_spec=None,
    indices=None,
) -> torch.Tensor:  # fmt: skip
    """q [T, H, D], kv [T, D], ring [rows, 1, D] (and compressed [rows, 1, D]) -> [T, H, D] in q.dtype."""
    tokens, heads, dim = q.shape
    out = torch.empty((tokens, heads, dim), dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kv.stride(-1) != 1:
        kv = kv.contiguous()
    rate = per_block = 1
    comp, idx, top_k = ring, kv, 0  # stand-ins the kernel does not read
    if compressed is not None:
        rate = compressed_spec.compress_rate
        per_block = compressed_spec.entries_per_block(block_size)
        comp = compressed
        if indices is not None:
            idx, top_k = indices.sort(dim=1).values, indices.shape[1]  # sorted: repeats side by side
    block_d = max(16, next_pow2(dim))
    block_h = min(max(16, next_pow2(heads)), 16 if block_d >= 256 else 64)
    launch = {} if INTERPRET else {"num_warps": 4 if block_d < 256 else 8, "num_stages": 2}
    tables = meta.block_tables
    _sparse_attention_kernel[(tokens, triton.cdiv(heads, block_h))](
        q, kv, ring, comp, idx, sinks, out, token_metadata(meta, tokens), meta.seq_slots, meta.window_starts,
        tables, heads, tokens, top_k, scale * LOG2E,
        q.stride(0), q.stride(1), kv.stride(0), ring.stride(0), comp.stride(0), idx.stride(0),
        out.stride(0), out.stride(1), tables.stride(0),
        D=dim, BD=block_d, WINDOW=ring_spec.window, RING=ring_spec.ring_size, RATE=rate, PER_BLOCK=per_block,
        COMPRESSED=compressed is not None, INDEXED=compressed is not None and indices is not None,
        BLOCK_H=block_h, BLOCK_N=16 if INTERPRET else (32 if block_d >= 256 else 64),
        F32=dot_in_float32(q.dtype), **launch,
    )  # fmt: skip
    return out
