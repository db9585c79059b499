"""Reference paged attention against dense per-sequence causal attention, and KV layout round trips."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer_core.backend.ops import AttentionMetadata
from deepinfer_core.kv.layout import CacheKind, CacheSpec, KVLayout, paged_slots, ring_slots
from deepinfer_core.reference.attention import ReferenceAttention
from deepinfer_core.reference.kv import ReferenceKVLayout

BLOCK = 4
CPU = torch.device("cpu")

# (seq_len, q_len): prefill, chunked prefill, empty row, decode; none a multiple of BLOCK
SEQS = [(7, 7), (10, 3), (5, 0), (9, 1)]


def _slot(table: list[int], pos: int) -> int:
    return table[pos // BLOCK] * BLOCK + pos % BLOCK


def _build(num_kv_heads: int, entry_dim: int, dtype=torch.float32, seed: int = 0):
    """A paged cache holding random entries for SEQS in shuffled blocks; returns what the test needs."""
    g = torch.Generator().manual_seed(seed)
    layout = ReferenceKVLayout(CPU, block_size=BLOCK)
    spec = CacheSpec(kind=CacheKind.PAGED, dtype=dtype, num_heads=num_kv_heads, head_dim=entry_dim)
    num_blocks = 16
    cache = layout.allocate(spec, num_blocks)
    assert cache.shape == (num_blocks * BLOCK, num_kv_heads, entry_dim)
    # garbage everywhere first: reading a wrong block must show up in the result
    layout.write(cache, spec, torch.arange(num_blocks * BLOCK), 50 * torch.randn(cache.shape, generator=g))
    free = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = 4
    tables, entries, slot_mapping, q_lens = [], [], [], []
    for seq_len, q_len in SEQS:
        n = -(-seq_len // BLOCK)
        table = [free.pop() for _ in range(n)]
        tables.append(table + [-1] * (max_blocks - n))
        kv = torch.randn(seq_len, num_kv_heads, entry_dim, generator=g).to(dtype)
        slots = torch.tensor([_slot(table, p) for p in range(seq_len)])
        layout.write(cache, spec, slots, kv)
        entries.append(kv)
        slot_mapping += [_slot(table, p) for p in range(seq_len - q_len, seq_len)]
        q_lens.append(q_len)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0] + q_lens).cumsum(0),
        seq_lens=torch.tensor([s for s, _ in SEQS]),
        block_tables=torch.tensor(tables),
        slot_mapping=torch.tensor(slot_mapping),
    )
    return layout, spec, cache, meta, entries


def _dense_expected(q, entries, meta, key_dim, value_dim, value_offset, scale):
    """Explicit causal softmax attention per sequence, per query, per head, in float64."""
    num_heads = q.shape[1]
    out = torch.zeros(q.shape[0], num_heads, value_dim, dtype=torch.float64)
    starts = meta.query_start_loc.tolist()
    for b, kv in enumerate(entries):
        kv = kv.double()
        seq_len, num_kv = kv.shape[0], kv.shape[1]
        q_len = starts[b + 1] - starts[b]
        for i in range(q_len):
            pos = seq_len - q_len + i
            for h in range(num_heads):
                kvh = h // (num_heads // num_kv)
                qv = q[starts[b] + i, h].double()
                logits = [float(qv @ kv[s, kvh, :key_dim]) * scale for s in range(pos + 1)]
                m = max(logits)
                w = [math.exp(x - m) for x in logits]
                total = sum(w)
                acc = torch.zeros(value_dim, dtype=torch.float64)
                for s in range(pos + 1):
                    acc += w[s] / total * kv[s, kvh, value_offset : value_offset + value_dim]
                out[starts[b] + i, h] = acc
    return out


CASES = {
    # MLA weight-absorbed: one latent entry (kv_lora_rank 8 + rope 4), values = its first 8 dims
    "mla": dict(num_heads=4, num_kv_heads=1, key_dim=12, entry_dim=12, value_dim=8, value_offset=0),
    # standard K|V side by side with GQA, value dim != key dim
    "gqa": dict(num_heads=4, num_kv_heads=2, key_dim=8, entry_dim=14, value_dim=6, value_offset=8),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_paged_attention_matches_dense_causal(case):
    layout, spec, cache, meta, entries = _build(case["num_kv_heads"], case["entry_dim"])
    num_tokens = int(meta.query_start_loc[-1])
    q = torch.randn(num_tokens, case["num_heads"], case["key_dim"], generator=torch.Generator().manual_seed(9))
    scale = case["key_dim"] ** -0.5
    out = ReferenceAttention(layout).paged_attention(
        q, cache, spec, meta, scale=scale, value_dim=case["value_dim"], value_offset=case["value_offset"]
    )
    assert out.shape == (num_tokens, case["num_heads"], case["value_dim"]) and out.dtype == q.dtype
    expected = _dense_expected(q, entries, meta, case["key_dim"], case["value_dim"], case["value_offset"], scale)
    torch.testing.assert_close(out, expected.float(), atol=1e-5, rtol=1e-4)
    # every query head gets its own answer: GQA groups share keys but not queries
    assert not torch.allclose(out[:, 0], out[:, 1])


def test_paged_attention_bfloat16_returns_q_dtype():
    case = CASES["gqa"]
    layout, spec, cache, meta, entries = _build(case["num_kv_heads"], case["entry_dim"], dtype=torch.bfloat16)
    num_tokens = int(meta.query_start_loc[-1])
    q = torch.randn(num_tokens, 4, 8, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    out = ReferenceAttention(layout).paged_attention(q, cache, spec, meta, scale=0.35, value_dim=6, value_offset=8)
    assert out.dtype == torch.bfloat16
    expected = _dense_expected(q, entries, meta, 8, 6, 8, 0.35)
    torch.testing.assert_close(out, expected.to(torch.bfloat16))


def test_paged_attention_ignores_context_beyond_seq_len():
    case = CASES["gqa"]
    layout, spec, cache, meta, entries = _build(case["num_kv_heads"], case["entry_dim"])
    q = torch.randn(int(meta.query_start_loc[-1]), 4, 8, generator=torch.Generator().manual_seed(4))
    attn = ReferenceAttention(layout)
    before = attn.paged_attention(q, cache, spec, meta, scale=0.3, value_dim=6, value_offset=8)
    # the unused tail of each sequence's last block holds stale data: overwrite it, nothing may change
    for b, (seq_len, _) in enumerate(SEQS):
        table = meta.block_tables[b].tolist()
        tail = [_slot(table, p) for p in range(seq_len, -(-seq_len // BLOCK) * BLOCK)]
        if tail:
            layout.write(cache, spec, torch.tensor(tail), torch.full((len(tail), 2, 14), 1e4))
    after = attn.paged_attention(q, cache, spec, meta, scale=0.3, value_dim=6, value_offset=8)
    torch.testing.assert_close(after, before)


# ------------------------------------------------------------------------------- KV layout round trips


def test_reference_layout_satisfies_protocol():
    layout = ReferenceKVLayout(CPU, block_size=BLOCK)
    assert isinstance(layout, KVLayout) and layout.block_size == BLOCK
    assert ReferenceKVLayout(CPU).block_size == 128


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_round_trip(dtype):
    g = torch.Generator().manual_seed(11)
    layout = ReferenceKVLayout(CPU, block_size=BLOCK)
    spec = CacheSpec(kind=CacheKind.PAGED, dtype=dtype, num_heads=2, head_dim=3)
    cache = layout.allocate(spec, 6)
    assert cache.shape == (6 * BLOCK, 2, 3) and cache.dtype == dtype and not cache.any()
    table = torch.tensor([4, 1, 5])
    positions = torch.arange(10)
    slots = paged_slots(table, positions, BLOCK)
    assert slots.tolist() == [_slot([4, 1, 5], p) for p in range(10)]
    values = torch.randn(10, 2, 3, generator=g)
    layout.write(cache, spec, slots, values)
    torch.testing.assert_close(layout.gather(cache, spec, slots), values.to(dtype))
    perm = torch.randperm(10, generator=g)  # gather honours the order asked for
    torch.testing.assert_close(layout.gather(cache, spec, slots[perm]), values[perm].to(dtype))
    untouched = torch.tensor([s for s in range(6 * BLOCK) if s not in slots.tolist()])
    assert not layout.gather(cache, spec, untouched).any()


def test_sliding_window_ring_wraps_modulo_window_plus_rollback():
    g = torch.Generator().manual_seed(12)
    layout = ReferenceKVLayout(CPU, block_size=BLOCK)
    spec = CacheSpec(
        kind=CacheKind.SLIDING_WINDOW, dtype=torch.float32, num_heads=1, head_dim=2, window=4, rollback_slots=2
    )
    ring = spec.ring_size
    assert ring == 6
    cache = layout.allocate(spec, 3)
    assert cache.shape == (3 * ring, 1, 2)
    positions = torch.arange(15)
    slots = ring_slots(1, positions, ring)
    assert slots.tolist() == [1 * 6 + p % 6 for p in range(15)]
    values = torch.randn(15, 1, 2, generator=g)
    for start in range(0, 15, 4):  # prefill chunk, then more steps; each write has distinct slots
        layout.write(cache, spec, slots[start : start + 4], values[start : start + 4])
    last = positions[-ring:]  # the ring holds exactly the newest ring_size tokens
    torch.testing.assert_close(layout.gather(cache, spec, ring_slots(1, last, ring)), values[-ring:])
    # an old position's slot now holds the token that wrapped onto it
    torch.testing.assert_close(layout.gather(cache, spec, ring_slots(1, torch.tensor([2]), ring)), values[14:15])
    # other sequences' rings are untouched
    assert not layout.gather(cache, spec, torch.tensor([0, 1, 2, 3, 4, 5, 12, 17])).any()


def test_sequence_state_round_trip():
    g = torch.Generator().manual_seed(13)
    layout = ReferenceKVLayout(CPU, block_size=BLOCK)
    spec = CacheSpec(kind=CacheKind.SEQUENCE_STATE, dtype=torch.float32, state_shape=(3, 5))
    assert spec.entry_shape == (3, 5)
    cache = layout.allocate(spec, 4)
    assert cache.shape == (4, 3, 5)
    values = torch.randn(2, 3, 5, generator=g)
    layout.write(cache, spec, torch.tensor([2, 0]), values)
    torch.testing.assert_close(layout.gather(cache, spec, torch.tensor([0, 2])), values[[1, 0]])
    assert not layout.gather(cache, spec, torch.tensor([1, 3])).any()
    layout.write(cache, spec, torch.tensor([2]), values[1:])  # overwrite in place
    torch.testing.assert_close(layout.gather(cache, spec, torch.tensor([2])), values[1:])


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(kind=CacheKind.SEQUENCE_STATE),
        dict(kind=CacheKind.PAGED, num_heads=1, head_dim=0),
        dict(kind=CacheKind.PAGED, num_heads=0, head_dim=4),
        dict(kind=CacheKind.SLIDING_WINDOW, num_heads=1, head_dim=4, window=0),
    ],
)
def test_cache_spec_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        CacheSpec(dtype=torch.float32, **kwargs)
