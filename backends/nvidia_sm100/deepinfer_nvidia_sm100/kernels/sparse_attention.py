"""DeepSeek-V4's sparse attention (one shared key = value head): sliding window, compressed entries and sinks.

A query token t attends, for each of its H heads, to its key sequence:
  (a) the window: positions since = max(t - window + 1, min(window_start, first)) .. t, read from the sequence's
      ring (row `seq_slot * ring_size + p % ring_size`) for positions before the step's first token `first`,
      and from this step's `kv` rows for the others (ring entries before `window_start` are never read);
  (b) compressed entries w < (t + 1) // m: all of them, or those listed in the query's `indices` row, sorted
      on the device beforehand so a repeated entry is skipped by comparing with its left neighbour.
The caches are row-per-slot tensors (PackedKVLayout, the nvidia_sm100 layout): [rows, 1, D] of q's dtype, or, for a
spec with a stored_format, packed rows [rows, bytes] (kernels.packed); this step's kv rows are always q's dtype.
A packed ring is staged (kernels.packed.stage_ring: the step's rings decoded once, not once per head block and
query). Packed compressed entries are staged (stage_blocks) or decoded in the kernel's registers (`stage`):
staged while the scratch stays within STAGE_MAX_BYTES and, for top-k picks, the step's blocks hold no more
entries than its queries' picks together (not so in a long context's decode). Both read the same values with the same
tiles, and under Triton's interpreter give the same bits; compiled for an H200 at V4.1 Flash's width they have
differed in the last bit of a few outputs, so the batch-invariant mode fixes the choice (stage=False).

Splits. The key sequence is cut into splits of SPLIT_KEYS keys: the window's positions from `since` on, then
the compressed entries (slots of the sorted index row, or entries 0 .. visible - 1), each part on its own, so a
split never mixes the two. A split's online softmax (float32, log2 domain) starts empty (running max -inf,
denominator 0) and walks its keys in tiles (BLOCK_NW window keys, BLOCK_NC compressed entries); `_merge` then
folds the splits, in split order, into the state of the head's sink (running max = the sink logit, denominator
1, no value), and the output is acc / denominator. One program serves BLOCK_H heads: they share the key head,
so each key tile [keys, D] is multiplied by all of them (q [BLOCK_H, D] x K^T) and serves as the values of the
same tile.

Two launches compute the same operations in the same order (the same jit functions, the same tiles, explicit
fmas in the fold), so a query's bits are the same from both:
  - split (small T): one program per (query, head block, split) stores its split's state in a float32
    workspace, and `_merge_splits_kernel` folds them per (query, head block, D tile). A decode step of batch 1
    at V4 Flash's shapes launches 5 programs of <= 128 keys (CSA: window + top 512) instead of 1 of 640;
  - single pass (large T: prefill, big batches): one program per (query, head block) computes its splits one
    after the other and folds each as it goes. No workspace, which would grow as T x splits x H x D.
The split launch is taken while the single pass's grid (T x head blocks) is under SINGLE_PASS_PROGRAMS (two
waves of an H200's SMs: past that the single pass fills the GPU, and splitting would only add the workspace's
traffic), the keys may need more than one split, and the split grid stays within MAX_SPLIT_PROGRAMS (which
bounds the workspace: 128 MiB at V4 Flash's shapes). All three come from host-known shapes only.

Batch invariance: a query's splits, the keys in each, their order and the fold order are functions of its
own position, window start, index row, SPLIT_KEYS and the tiles (constants, or functions of the caches' specs
and formats: never derived from T, the grid or whether a cache was staged), with `stage` given. The grid's
split axis is a static bound from shapes (window + top_k, or the block-table width x entries per block);
a program past its query's keys stores an empty state, and folding an empty state leaves the running one as it
is, bit for bit, so neither that bound nor the launch taken changes a query's result. Per-token metadata
(sequence, position, first step position, first kv row) is built with torch ops on the device: no host reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia_sm100.kernels import packed
from deepinfer_nvidia_sm100.kernels._common import INTERPRET, dot_in_float32, mma, next_pow2
from deepinfer_nvidia_sm100.kernels.packed import format_code, load_rows, stage_blocks, stage_ring, staged_bytes

__all__ = ["sparse_attention"]

LOG2E = 1.4426950408889634
SPLIT_KEYS = 128  # keys per split: V4 Flash's window is one split, its top 512 entries four
SINGLE_PASS_PROGRAMS = 2 * 132  # T x head blocks from which the single pass runs: two waves of an H200
MAX_SPLIT_PROGRAMS = 1024  # nor is a split grid of more programs launched (workspace: that x BLOCK_H x D x 4 B)


@triton.jit
def _attend(q, keys, visible, m, denom, acc, scale_log2, F32: tl.constexpr):
    """One online-softmax step of q [BH, BD] over keys [BN, BD] (= values), `visible` [BN] or [BH, BN]."""
    scores = mma(q, tl.trans(keys), tl.zeros((q.shape[0], keys.shape[0]), dtype=tl.float32), F32) * scale_log2
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet: stay at 0
    p = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(m - m_safe)
    denom = tl.fma(denom, alpha, tl.sum(p, axis=1))
    acc = mma(p.to(keys.dtype), keys, acc * alpha[:, None], F32)
    return m_new, denom, acc


@triton.jit
def _merge(m, denom, acc, split_m, split_denom, split_acc):
    """The running state with a split's state folded in. A split that saw nothing (split_m = -inf) leaves it as
    it is, bit for bit; explicit fmas, so both launches round the fold the same way."""
    m_new = tl.maximum(m, split_m)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha, beta = tl.exp2(m - m_safe), tl.exp2(split_m - m_safe)
    seen = split_m > float("-inf")
    denom = tl.where(seen, tl.fma(denom, alpha, split_denom * beta), denom)
    acc = tl.where(seen[:, None], tl.fma(acc, alpha[:, None], split_acc * beta[:, None]), acc)
    return m_new, denom, acc


@triton.jit
def _sink_state(sinks_ptr, heads, live, BD: tl.constexpr):
    """The running state before any key: max = the sink logit, denominator exp2(sink - max) = 1, no value."""
    m = tl.load(sinks_ptr + heads, mask=live, other=0.0).to(tl.float32) * 1.4426950408889634
    denom = tl.where(m == float("-inf"), 0.0, 1.0)  # a -inf sink is no term at all
    return m, denom, tl.zeros((heads.shape[0], BD), dtype=tl.float32)


@triton.jit
def _store_out(out_ptr, t, heads, d, mask, denom, acc, so_t, so_h):
    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    out_rows = out_ptr + t.to(tl.int64) * so_t + heads[:, None] * so_h
    tl.store(out_rows + d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _query(tok_ptr, window_starts_ptr, T, t, WINDOW: tl.constexpr, RATE: tl.constexpr):
    """Query t's sequence, position, step's first position and row, first window position and visible entries."""
    seq = tl.load(tok_ptr + t)  # tok [4, T]: sequence, position, first step position, first step row
    pos = tl.load(tok_ptr + T + t)
    first = tl.load(tok_ptr + 2 * T + t)
    row0 = tl.load(tok_ptr + 3 * T + t)
    since = tl.maximum(pos - (WINDOW - 1), tl.minimum(tl.load(window_starts_ptr + seq), first))
    return seq, pos, first, row0, since, (pos + 1) // RATE


@triton.jit
def _query_heads(q_ptr, t, head_block, H, sq_t, sq_h, D: tl.constexpr, BD: tl.constexpr, BLOCK_H: tl.constexpr):
    """Head block `head_block` of query t: (heads, live heads, d, d < D, q [BLOCK_H, BD])."""
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    live = heads < H
    d = tl.arange(0, BD)
    in_d = d < D
    q = load_rows(q_ptr + t.to(tl.int64) * sq_t, heads.to(tl.int64), sq_h, live, d, in_d, 0, D)
    return heads, live, d, in_d, q


@triton.jit
def _window_split(
    q, split, kv_ptr, ring_ptr, skv, sring, ring_base, since, pos, first, row0, d, in_d, scale_log2,
    RING: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, F32: tl.constexpr,
):  # fmt: skip
    """The state over window positions since + split * SPLIT .. (up to pos): ring rows before `first`, this
    step's rows from `first` on (the same dtype: one load per entry). Empty past pos."""
    m = tl.full((q.shape[0],), float("-inf"), dtype=tl.float32)
    denom = tl.zeros((q.shape[0],), dtype=tl.float32)
    acc = tl.zeros(q.shape, dtype=tl.float32)
    lo = since + split * SPLIT
    for start in range(lo, tl.minimum(lo + SPLIT, pos + 1), BLOCK_N):
        p = start + tl.arange(0, BLOCK_N)
        in_ring = p < first
        in_step = (p >= first) & (p <= pos)
        ring_rows = ring_ptr + (ring_base + p % RING).to(tl.int64) * sring
        rows = tl.where(in_ring, ring_rows, kv_ptr + (row0 + p - first).to(tl.int64) * skv)
        keys = tl.load(rows[:, None] + d[None, :], (in_ring | in_step)[:, None] & in_d[None, :], other=0.0)
        m, denom, acc = _attend(q, keys, (in_ring | in_step)[None, :], m, denom, acc, scale_log2, F32)
    return m, denom, acc


@triton.jit
def _window(
    q, m, denom, acc, kv_ptr, ring_ptr, skv, sring, ring_base, since, pos, first, row0, d, in_d, scale_log2,
    RING: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, F32: tl.constexpr,
):  # fmt: skip
    """The running state with the window's splits (positions since .. pos) folded in, one after the other."""
    for split in range(0, (pos - since + SPLIT) // SPLIT):
        split_m, split_denom, split_acc = _window_split(
            q, split, kv_ptr, ring_ptr, skv, sring, ring_base, since, pos, first, row0, d, in_d, scale_log2,
            RING, SPLIT, BLOCK_N, F32,
        )  # fmt: skip
        m, denom, acc = _merge(m, denom, acc, split_m, split_denom, split_acc)
    return m, denom, acc


@triton.jit
def _compressed_split(
    q, split, comp_ptr, scomp, table, idx_row, K, visible, d, in_d, scale_log2, PER_BLOCK: tl.constexpr,
    COMPRESSED: tl.constexpr, INDEXED: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, F32: tl.constexpr,
    COMP_FMT: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    """The state over compressed split `split`: slots split * SPLIT .. of the sorted index row (-1, not yet
    visible and repeated entries skipped), or entries split * SPLIT .. visible - 1. Empty past them."""
    m = tl.full((q.shape[0],), float("-inf"), dtype=tl.float32)
    denom = tl.zeros((q.shape[0],), dtype=tl.float32)
    acc = tl.zeros(q.shape, dtype=tl.float32)
    if COMPRESSED:
        lo = split * SPLIT
        if INDEXED:
            hi = tl.minimum(lo + SPLIT, K)
            # sorted: a split whose last pick is -1 or whose first is not yet visible picks nothing
            nothing = (tl.load(idx_row + hi - 1) < 0) | (tl.load(idx_row + lo) >= visible)
            hi = tl.where(nothing, lo, hi)
        else:
            hi = tl.minimum(lo + SPLIT, visible)
        for start in range(lo, hi, BLOCK_N):
            k = start + tl.arange(0, BLOCK_N)
            if INDEXED:
                w = tl.load(idx_row + k, mask=k < hi, other=-1)
                before = tl.load(idx_row + k - 1, mask=(k > 0) & (k < hi), other=-1)  # a repeat follows its twin
                chosen = (w >= 0) & (w < visible) & ((w != before) | (k == 0))
            else:
                w = k
                chosen = k < hi
            # an entry in 0 .. visible - 1 (min / max, no mask: triton 3.6's layout pass fails on a masked load here)
            block_id = tl.load(table + tl.minimum(tl.maximum(w, 0), tl.maximum(visible - 1, 0)) // PER_BLOCK)
            rows = (block_id * PER_BLOCK + w % PER_BLOCK).to(tl.int64)
            keys = load_rows(comp_ptr, rows, scomp, chosen, d, in_d, COMP_FMT, D)
            m, denom, acc = _attend(q, keys.to(q.dtype), chosen[None, :], m, denom, acc, scale_log2, F32)
    return m, denom, acc


@triton.jit
def _sparse_attention_kernel(
    q_ptr, kv_ptr, ring_ptr, comp_ptr, idx_ptr, sinks_ptr, out_ptr, tok_ptr,
    seq_slots_ptr, window_starts_ptr, tables_ptr, H, T, K, scale_log2,
    sq_t, sq_h, skv, sring, scomp, sidx, so_t, so_h, st_b,
    D: tl.constexpr, BD: tl.constexpr, WINDOW: tl.constexpr, RING: tl.constexpr, RATE: tl.constexpr,
    PER_BLOCK: tl.constexpr, COMPRESSED: tl.constexpr, INDEXED: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_NW: tl.constexpr, BLOCK_NC: tl.constexpr, F32: tl.constexpr, COMP_FMT: tl.constexpr,
):  # fmt: skip
    """Single pass: one program per (query, head block) folds its splits one after the other."""
    t, head_block = tl.program_id(0), tl.program_id(1)
    seq, pos, first, row0, since, visible = _query(tok_ptr, window_starts_ptr, T, t, WINDOW, RATE)
    heads, live, d, in_d, q = _query_heads(q_ptr, t, head_block, H, sq_t, sq_h, D, BD, BLOCK_H)
    m, denom, acc = _sink_state(sinks_ptr, heads, live, BD)

    ring_base = tl.load(seq_slots_ptr + seq) * RING
    m, denom, acc = _window(
        q, m, denom, acc, kv_ptr, ring_ptr, skv, sring, ring_base, since, pos, first, row0, d, in_d, scale_log2,
        RING, SPLIT, BLOCK_NW, F32,
    )  # fmt: skip
    if COMPRESSED:
        table, idx_row = tables_ptr + seq.to(tl.int64) * st_b, idx_ptr + t.to(tl.int64) * sidx
        keys = K if INDEXED else visible
        for split in range(0, tl.cdiv(keys, SPLIT)):
            split_m, split_denom, split_acc = _compressed_split(
                q, split, comp_ptr, scomp, table, idx_row, K, visible, d, in_d, scale_log2,
                PER_BLOCK, COMPRESSED, INDEXED, SPLIT, BLOCK_NC, F32, COMP_FMT, D,
            )  # fmt: skip
            m, denom, acc = _merge(m, denom, acc, split_m, split_denom, split_acc)
    _store_out(out_ptr, t, heads, d, live[:, None] & in_d[None, :], denom, acc, so_t, so_h)


@triton.jit
def _sparse_attention_split_kernel(
    q_ptr, kv_ptr, ring_ptr, comp_ptr, idx_ptr, ws_m_ptr, ws_denom_ptr, ws_acc_ptr, tok_ptr,
    seq_slots_ptr, window_starts_ptr, tables_ptr, H, T, K, SPLITS, scale_log2,
    sq_t, sq_h, skv, sring, scomp, sidx, st_b,
    D: tl.constexpr, BD: tl.constexpr, WINDOW: tl.constexpr, RING: tl.constexpr, RATE: tl.constexpr,
    PER_BLOCK: tl.constexpr, COMPRESSED: tl.constexpr, INDEXED: tl.constexpr, SPLIT: tl.constexpr,
    WINDOW_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_NW: tl.constexpr, BLOCK_NC: tl.constexpr,
    F32: tl.constexpr, COMP_FMT: tl.constexpr,
):  # fmt: skip
    """Split launch: one program per (query, head block, split) stores its split's state in the workspace
    (m, denom [T, SPLITS, H], acc [T, SPLITS, H, D]); splits 0 .. WINDOW_SPLITS - 1 are the window's."""
    t, head_block, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq, pos, first, row0, since, visible = _query(tok_ptr, window_starts_ptr, T, t, WINDOW, RATE)
    heads, live, d, in_d, q = _query_heads(q_ptr, t, head_block, H, sq_t, sq_h, D, BD, BLOCK_H)

    if split < WINDOW_SPLITS:
        ring_base = tl.load(seq_slots_ptr + seq) * RING
        m, denom, acc = _window_split(
            q, split, kv_ptr, ring_ptr, skv, sring, ring_base, since, pos, first, row0, d, in_d, scale_log2,
            RING, SPLIT, BLOCK_NW, F32,
        )  # fmt: skip
    else:
        table, idx_row = tables_ptr + seq.to(tl.int64) * st_b, idx_ptr + t.to(tl.int64) * sidx
        m, denom, acc = _compressed_split(
            q, split - WINDOW_SPLITS, comp_ptr, scomp, table, idx_row, K, visible, d, in_d, scale_log2,
            PER_BLOCK, COMPRESSED, INDEXED, SPLIT, BLOCK_NC, F32, COMP_FMT, D,
        )  # fmt: skip
    state = (t.to(tl.int64) * SPLITS + split) * H + heads  # [BLOCK_H]
    tl.store(ws_m_ptr + state, m, mask=live)
    tl.store(ws_denom_ptr + state, denom, mask=live)
    seen = live & (m > float("-inf"))  # the merge reads no acc of an empty state
    tl.store(ws_acc_ptr + state[:, None] * D + d[None, :], acc, mask=seen[:, None] & in_d[None, :])


@triton.jit
def _merge_splits_kernel(
    ws_m_ptr, ws_denom_ptr, ws_acc_ptr, sinks_ptr, out_ptr, H, SPLITS, so_t, so_h,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Folds a (query, head block, D tile)'s split states into its sink's state, in split order, and stores it."""
    t, head_block, d_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    live = heads < H
    d = d_block * BLOCK_D + tl.arange(0, BLOCK_D)
    in_d = d < D
    m, denom, acc = _sink_state(sinks_ptr, heads, live, BLOCK_D)
    for split in range(0, SPLITS):
        state = (t.to(tl.int64) * SPLITS + split) * H + heads
        split_m = tl.load(ws_m_ptr + state, mask=live, other=float("-inf"))
        split_denom = tl.load(ws_denom_ptr + state, mask=live, other=0.0)
        seen = live & (split_m > float("-inf"))
        tile = seen[:, None] & in_d[None, :]
        split_acc = tl.load(ws_acc_ptr + state[:, None] * D + d[None, :], mask=tile, other=0.0)
        m, denom, acc = _merge(m, denom, acc, split_m, split_denom, split_acc)
    _store_out(out_ptr, t, heads, d, live[:, None] & in_d[None, :], denom, acc, so_t, so_h)


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
    indices=None, split_keys: int = SPLIT_KEYS, split: bool | None = None, stage: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """q [T, H, D], kv [T, D], ring [rows, 1, D] (and compressed [rows, 1, D]), or packed [rows, bytes] where their
    spec has a stored_format -> [T, H, D] in q.dtype.

    split_keys: keys per split (a power of two; it sets the rounding, so it is fixed in production).
    split: the split launch (True) or the single pass (False), which give the same bits; None (production)
    chooses by the shapes, as the module docstring says.
    stage: whether packed compressed entries are staged (True) or decoded in the kernel (False); None chooses by
    the shapes (the module docstring; not batch-invariant on a GPU)."""
    tokens, heads, dim = q.shape
    out = torch.empty((tokens, heads, dim), dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    if split_keys < 1 or split_keys & (split_keys - 1):
        raise ValueError(f"split_keys must be a power of two, got {split_keys}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    seq_slots, tables = meta.seq_slots, meta.block_tables
    if format_code(ring, ring_spec):
        ring, seq_slots = stage_ring(ring, ring_spec, seq_slots, q.dtype)
    if kv.stride(-1) != 1 or kv.dtype != ring.dtype:  # a window tile reads rows of both with one load
        kv = kv.to(ring.dtype).contiguous()
    rate = per_block = 1
    comp, idx, top_k, compressed_keys = ring, kv, 0, 0  # stand-ins the kernels do not read
    comp_packed = compressed is not None and format_code(compressed, compressed_spec) != 0
    if compressed is not None:
        rate = compressed_spec.compress_rate
        per_block = compressed_spec.entries_per_block(block_size)
        comp, compressed_keys = compressed, tables.shape[1] * per_block  # at most the table's entries
        if indices is not None:
            # sorted (repeats side by side) as int32: half the radix passes of int64, the same values
            idx, top_k = indices.to(torch.int32).sort(dim=1).values, indices.shape[1]
            compressed_keys = top_k
        if comp_packed and stage is None:  # the step's entries decoded once, unless there are more than picks
            fits = staged_bytes(compressed_spec, tables, per_block, q.dtype) <= packed.STAGE_MAX_BYTES
            stage = fits and (indices is None or tables.numel() * per_block <= tokens * top_k)
        if comp_packed and stage:
            comp, tables = stage_blocks(compressed, compressed_spec, tables, per_block, q.dtype)
    window_splits = triton.cdiv(ring_spec.window, split_keys)
    splits = window_splits + triton.cdiv(compressed_keys, split_keys)  # a bound from shapes, never from values
    block_d = max(16, next_pow2(dim))
    # up to 64 heads a program, at any width: each key tile is loaded (and a packed one decoded) once for all of
    # V4 Flash's heads, and the MMAs are 64 rows tall (at 512 dims, 16 a program took 1.2-1.6x as long on an H200)
    block_h = min(max(16, next_pow2(heads)), 64)
    head_blocks = triton.cdiv(heads, block_h)
    launch = {} if INTERPRET else {"num_warps": 4 if block_d < 256 else 8, "num_stages": 2}
    block_nw = min(split_keys, 16 if INTERPRET else (32 if block_d >= 256 else 64))
    # top-k picks of packed entries may decode in registers: half the tile at V4 Flash's width, so the decode
    # does not spill; staged, they take the same tile
    block_nc = 16 if comp_packed and indices is not None and block_d >= 256 else block_nw
    inputs = (q, kv, ring, comp, idx)
    shared = (token_metadata(meta, tokens), seq_slots, meta.window_starts, tables, heads, tokens, top_k)
    strides = (q.stride(0), q.stride(1), kv.stride(0), ring.stride(0), comp.stride(0), idx.stride(0))
    constexprs = dict(
        D=dim, BD=block_d, WINDOW=ring_spec.window, RING=ring_spec.ring_size, RATE=rate, PER_BLOCK=per_block,
        COMPRESSED=compressed is not None, INDEXED=compressed is not None and indices is not None, SPLIT=split_keys,
        BLOCK_H=block_h, BLOCK_NW=block_nw, BLOCK_NC=min(split_keys, block_nc), F32=dot_in_float32(q.dtype),
        COMP_FMT=format_code(comp, compressed_spec), **launch,
    )  # fmt: skip
    if split is None:
        split = splits > 1 and tokens * head_blocks < SINGLE_PASS_PROGRAMS
        split &= tokens * head_blocks * splits <= MAX_SPLIT_PROGRAMS
    if not split:
        _sparse_attention_kernel[(tokens, head_blocks)](
            *inputs, sinks, out, *shared, scale * LOG2E, *strides, out.stride(0), out.stride(1), tables.stride(0),
            **constexprs,
        )  # fmt: skip
        return out
    ws_m = torch.empty((tokens, splits, heads), dtype=torch.float32, device=q.device)
    ws_denom = torch.empty((tokens, splits, heads), dtype=torch.float32, device=q.device)
    ws_acc = torch.empty((tokens, splits, heads, dim), dtype=torch.float32, device=q.device)
    _sparse_attention_split_kernel[(tokens, head_blocks, splits)](
        *inputs, ws_m, ws_denom, ws_acc, *shared, splits, scale * LOG2E, *strides, tables.stride(0),
        WINDOW_SPLITS=window_splits, **constexprs,
    )  # fmt: skip
    merge_d = min(block_d, 64)
    _merge_splits_kernel[(tokens, head_blocks, triton.cdiv(dim, merge_d))](
        ws_m, ws_denom, ws_acc, sinks, out, heads, splits, out.stride(0), out.stride(1),
        D=dim, BLOCK_H=block_h, BLOCK_D=merge_d, **({} if INTERPRET else {"num_warps": 4}),
    )  # fmt: skip
    return out
