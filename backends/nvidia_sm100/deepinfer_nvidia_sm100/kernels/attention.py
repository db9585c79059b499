"""Paged attention over a row-per-slot cache [slots, Hkv, Dc], prefill and decode in one kernel.

One program serves BLOCK_Q consecutive queries of one sequence for all G = H / Hkv query heads of one
cached head: its tile rows are (query, head) pairs, so MLA (Hkv = 1, G = H) reads each latent entry
once for every head. Keys are the first Dk dims of an entry, loaded as a power-of-two part and a
masked tail (MLA: 512 + 64); values are `value_dim` dims from `value_offset` and, when they are the
keys' first part, are not loaded twice. Keys are visited in BLOCK_N chunks from position 0 with an
online softmax; chunks past a row's own position are fully masked and leave it bit-for-bit
unchanged, so a query's result does not depend on the batch, its place in it or the prefill chunking.
Each program finds its sequence from the query offsets itself (a scan over the batch; no host reads).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia_sm100.kernels._common import INTERPRET, dot_in_float32, mma, next_pow2

LOG2E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    q_ptr, cache_ptr, out_ptr, qsl_ptr, seq_lens_ptr, tables_ptr, B, scale_log2,
    sq_t, sq_h, sc_slot, sc_h, so_t, so_h, st_b,
    G: tl.constexpr, DK: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr,
    HAS_TAIL: tl.constexpr, V_OFFSET: tl.constexpr, V_IS_K1: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_Q: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, F32: tl.constexpr,
):  # fmt: skip
    pid, kv_head = tl.program_id(0), tl.program_id(1)
    seqs = tl.arange(0, BLOCK_B)
    starts = tl.load(qsl_ptr + seqs, mask=seqs < B, other=0)
    ends = tl.load(qsl_ptr + seqs + 1, mask=seqs < B, other=0)
    block_end = tl.cumsum((ends - starts + BLOCK_Q - 1) // BLOCK_Q, axis=0)  # cumulative query blocks
    seq = tl.sum((block_end <= pid).to(tl.int32), axis=0)  # the sequence this program serves
    if seq >= B:
        return
    here = seqs == seq
    q_start = tl.sum(tl.where(here, starts, 0), axis=0)
    q_len = tl.sum(tl.where(here, ends - starts, 0), axis=0)
    q_block = pid - tl.sum(tl.where(here, block_end, 0), axis=0) + (q_len + BLOCK_Q - 1) // BLOCK_Q
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, ROWS)
    q_idx = q_block * BLOCK_Q + rows // G
    head = kv_head * G + rows % G
    valid = (rows < BLOCK_Q * G) & (q_idx < q_len)
    pos = seq_len - q_len + q_idx  # absolute position of each row's query
    q_rows = q_ptr + (q_start + q_idx).to(tl.int64)[:, None] * sq_t + head[:, None] * sq_h
    d1 = tl.arange(0, D1)
    d2 = D1 + tl.arange(0, D2)
    q1 = tl.load(q_rows + d1[None, :], mask=valid[:, None], other=0.0)
    q2 = tl.load(q_rows + d2[None, :], mask=valid[:, None] & (d2[None, :] < DK), other=0.0)
    dv = tl.arange(0, BDV)  # value dims

    m = tl.full((ROWS,), float("-inf"), dtype=tl.float32)
    denom = tl.zeros((ROWS,), dtype=tl.float32)
    acc = tl.zeros((ROWS, BDV), dtype=tl.float32)
    last_q = tl.minimum(q_len, (q_block + 1) * BLOCK_Q)
    n_end = seq_len - q_len + last_q  # keys this program needs: up to its last query's position
    for start in range(0, n_end, BLOCK_N):
        kp = start + tl.arange(0, BLOCK_N)
        in_range = kp < n_end
        block_id = tl.load(tables_ptr + seq * st_b + kp // BLOCK_SIZE, mask=in_range, other=0)
        slot = block_id * BLOCK_SIZE + kp % BLOCK_SIZE
        entry = cache_ptr + slot[:, None] * sc_slot + kv_head * sc_h
        k1 = tl.load(entry + d1[None, :], mask=in_range[:, None], other=0.0)  # [BLOCK_N, D1]
        scores = mma(q1, tl.trans(k1), tl.zeros((ROWS, BLOCK_N), dtype=tl.float32), F32)
        if HAS_TAIL:
            k2 = tl.load(entry + d2[None, :], mask=in_range[:, None] & (d2[None, :] < DK), other=0.0)
            scores = mma(q2, tl.trans(k2), scores, F32)
        scores = scores * scale_log2
        causal = (kp[None, :] <= pos[:, None]) & in_range[None, :]
        scores = tl.where(causal, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay at 0
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        denom = denom * alpha + tl.sum(p, axis=1)
        if V_IS_K1:
            v = k1
        else:
            v = tl.load(entry + V_OFFSET + dv[None, :], mask=in_range[:, None] & (dv[None, :] < DV), other=0.0)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], F32)
        m = m_new
    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    out_rows = out_ptr + (q_start + q_idx).to(tl.int64)[:, None] * so_t + head[:, None] * so_h
    tl.store(out_rows + dv[None, :], out.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (dv[None, :] < DV))


def _prev_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def paged_attention(q, cache, spec, meta, block_size: int, *, scale: float, value_dim: int, value_offset: int = 0):
    """q [T, H, Dk] over `cache` [slots, Hkv, Dc] (row per slot) -> [T, H, value_dim] in q.dtype."""
    tokens, heads, key_dim = q.shape
    kv_heads = spec.num_heads
    group = heads // kv_heads
    out = torch.empty((tokens, heads, value_dim), dtype=q.dtype, device=q.device)
    batch = meta.num_seqs
    if tokens == 0 or batch == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    block_q = max(1, 16 // group)
    d1 = _prev_pow2(key_dim)
    d2 = max(16, next_pow2(key_dim - d1))  # the masked tail of the key dims (tl.dot needs >= 16)
    launch = {} if INTERPRET else {"num_warps": 4 if d1 < 256 else 8, "num_stages": 2}
    _paged_attention_kernel[(triton.cdiv(tokens, block_q) + batch, kv_heads)](
        q, cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, batch,
        scale * LOG2E, q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), out.stride(0), out.stride(1),
        meta.block_tables.stride(0),
        G=group, DK=key_dim, D1=d1, D2=d2, DV=value_dim, BDV=max(16, next_pow2(value_dim)), HAS_TAIL=key_dim > d1,
        V_OFFSET=value_offset, V_IS_K1=value_offset == 0 and value_dim == d1, BLOCK_SIZE=block_size,
        BLOCK_B=next_pow2(batch), BLOCK_Q=block_q, ROWS=max(16, next_pow2(block_q * group)),
        BLOCK_N=16 if INTERPRET else (32 if d1 >= 256 else 64), F32=dot_in_float32(q.dtype), **launch,
    )  # fmt: skip
    return out
