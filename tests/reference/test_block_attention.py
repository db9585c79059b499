"""Reference block_attention (DSpark's draft blocks) against an explicit float64 softmax with a sink over each
block's window entries and its own rows, and unlike the causal and shorter-window variants of that formula."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from deepinfer_core.backend.ops import AttentionMetadata
from deepinfer_core.kv.layout import CacheKind, CacheSpec, ring_slots
from deepinfer_core.reference.attention import ReferenceAttention
from deepinfer_core.reference.kv import ReferenceKVLayout

CPU = torch.device("cpu")
HEADS, DIM, WINDOW, ROLLBACK, SCALE = 3, 8, 4, 2, 0.4
# (seq_len, block rows, window_start): no context, a short one, a wrapped ring (ring of 6), a window start that
# cuts the window, one block of a single row
BLOCKS = [(3, 3, 0), (5, 3, 0), (23, 4, 0), (30, 2, 26), (12, 1, 0)]


def _step(seed: int = 0):
    """A ring holding each sequence's entries of positions max(first - WINDOW, window_start, 0) .. first - 1 at
    shuffled slots, poison everywhere else; (ring, spec, meta, q, kv, per-sequence entries [seq_len, D])."""
    g = torch.Generator().manual_seed(seed)
    layout = ReferenceKVLayout(CPU, block_size=4)
    spec = CacheSpec(CacheKind.SLIDING_WINDOW, torch.float32, 1, DIM, window=WINDOW, rollback_slots=ROLLBACK)
    num_slots = len(BLOCKS) + 1
    ring = layout.allocate(spec, num_slots)
    layout.write(ring, spec, torch.arange(ring.shape[0]), 50 * torch.randn(ring.shape, generator=g))
    seq_slots = torch.randperm(num_slots, generator=g)[: len(BLOCKS)]
    entries, kv = [], []
    for (seq_len, rows, start), slot in zip(BLOCKS, seq_slots.tolist()):
        values = torch.randn(seq_len, DIM, generator=g)
        first = seq_len - rows
        seen = torch.arange(max(first - WINDOW, start, 0), first)
        layout.write(ring, spec, ring_slots(slot, seen, spec.ring_size), values[seen, None, :])
        entries.append(values)
        kv.append(values[first:])
    tokens = sum(rows for _, rows, _ in BLOCKS)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0] + [rows for _, rows, _ in BLOCKS]).cumsum(0),
        seq_lens=torch.tensor([seq_len for seq_len, _, _ in BLOCKS]),
        block_tables=torch.zeros(len(BLOCKS), 1, dtype=torch.int64),
        slot_mapping=torch.zeros(tokens, dtype=torch.int64),
        seq_slots=seq_slots,
        window_starts=torch.tensor([start for _, _, start in BLOCKS]),
        max_query_len=max(rows for _, rows, _ in BLOCKS),
    )
    q = torch.randn(tokens, HEADS, DIM, generator=g)
    return layout, ring, spec, meta, q, torch.cat(kv), entries


def _dense(q, entries, sinks, *, causal: bool = False, reach: int = WINDOW) -> torch.Tensor:
    """Per query and head: softmax over [q.k * SCALE for k in the keys] + [sink], the sink's weight dropped, in
    float64. Keys: positions max(first - reach, window_start, 0) .. seq_len - 1 (up to the query's own with
    `causal`)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    t = 0
    for (seq_len, rows, start), values in zip(BLOCKS, entries):
        first = seq_len - rows
        for i in range(rows):
            last = first + i if causal else seq_len - 1
            keys = values[max(first - reach, start, 0) : last + 1].double()  # [S, D]
            for h in range(HEADS):
                logits = [float(q[t, h].double() @ k) * SCALE for k in keys]
                top = max(logits + [float(sinks[h])])
                weights = [math.exp(x - top) for x in logits]
                total = sum(weights) + math.exp(float(sinks[h]) - top)
                out[t, h] = sum(w / total * k for w, k in zip(weights, keys))
            t += 1
    return out


@pytest.mark.parametrize("sink_scale", [0.0, 3.0], ids=["zero_sinks", "large_sinks"])
def test_block_attention_matches_dense_softmax_with_sink(sink_scale):
    layout, ring, spec, meta, q, kv, entries = _step()
    sinks = torch.randn(HEADS, generator=torch.Generator().manual_seed(1)) * sink_scale
    before = ring.clone()
    out = ReferenceAttention(layout).block_attention(q, kv, ring, spec, meta, sinks=sinks, scale=SCALE)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.equal(ring, before), "nothing is written"
    torch.testing.assert_close(out, _dense(q, entries, sinks).float(), rtol=1e-5, atol=1e-5)
    # the formula decides: a causal block, or a window one entry shorter, is a different answer
    for other in (_dense(q, entries, sinks, causal=True), _dense(q, entries, sinks, reach=WINDOW - 1)):
        assert not torch.allclose(out, other.float(), rtol=1e-3, atol=1e-3)


def test_block_attention_returns_q_dtype_from_float32_sums():
    layout, ring, spec, meta, q, kv, entries = _step(seed=2)
    sinks = torch.randn(HEADS, generator=torch.Generator().manual_seed(3))
    ring16, spec16 = ring.to(torch.bfloat16), dataclasses.replace(spec, dtype=torch.bfloat16)
    q16, kv16 = q.to(torch.bfloat16), kv.to(torch.bfloat16)
    out = ReferenceAttention(layout).block_attention(q16, kv16, ring16, spec16, meta, sinks=sinks, scale=SCALE)
    assert out.dtype == torch.bfloat16
    rounded = [values.to(torch.bfloat16).float() for values in entries]  # what the bfloat16 caches hold
    expected = _dense(q16.float(), rounded, sinks).to(torch.bfloat16)
    torch.testing.assert_close(out, expected)
