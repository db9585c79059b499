"""DeepSeek-V4's sparse attention kernel against ReferenceAttention.sparse_attention, under Triton's interpreter:
ragged batches of prefills, chunks and decodes over rings and compressed caches whose stale slots hold poison;
keys split in many small splits, by both launches (split and single pass), whose bits must agree."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from deepinfer_core.backend.ops import AttentionMetadata
from deepinfer_core.kv.layout import CacheKind, CacheSpec, compressed_slots, ring_slots
from deepinfer_core.reference.attention import ReferenceAttention
from deepinfer_core.reference.kv import ReferenceKVLayout
from deepinfer_nvidia_sm100.kernels import sparse_attention
from deepinfer_nvidia_sm100.ops import NvidiaAttention

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]
WINDOW, ROLLBACK = 8, 6  # ring of 14 slots

# (seq_len, q_len, window_start): a prefill past the ring's size, a chunk after context, no queries, a decode,
# a chunk whose positions wrapped the ring many times, window starts that cut a decode's and a chunk's window,
# one at the step's first token (nothing in the ring is its own yet), a long decode (rate 128 entries)
SEQS = [(27, 27, 0), (50, 6, 0), (20, 0, 0), (33, 1, 0), (130, 3, 0), (30, 2, 25), (40, 6, 30), (21, 4, 17)]
SEQS += [(259, 2, 0)]
# (block_size, compress_rate): V4's CSA-like rate 4, and an HCA-like rate of a whole block per entry
RATES = {"rate4": (16, 4), "rate128": (128, 128)}


@dataclass(frozen=True, slots=True)
class V4Batch:
    """One step's tensors over random caches in ReferenceKVLayout, every slot the step must not read poisoned."""

    layout: ReferenceKVLayout
    ring_spec: CacheSpec
    comp_spec: CacheSpec
    ring: torch.Tensor  # [seqs * ring_size, 1, D]
    compressed: torch.Tensor  # [blocks * entries per block, 1, D]
    meta: AttentionMetadata
    q: torch.Tensor  # [T, H, D]
    kv: torch.Tensor  # [T, D]

    def positions(self) -> torch.Tensor:
        """[T]: each query's position."""
        starts, lens = self.meta.query_start_loc.tolist(), self.meta.seq_lens.tolist()
        return torch.cat([torch.arange(n - (starts[b + 1] - starts[b]), n) for b, n in enumerate(lens)])

    def attend(self, backend, mode: str, sinks: torch.Tensor, indices=None, **overrides) -> torch.Tensor:
        args = dict(q=self.q, kv=self.kv, ring=self.ring, meta=self.meta) | overrides
        extra = {} if mode == "window" else dict(compressed=self.compressed, compressed_spec=self.comp_spec)
        return backend.sparse_attention(
            args["q"], args["kv"], args["ring"], self.ring_spec, args["meta"],
            sinks=sinks, scale=0.4, indices=indices, **extra,
        )  # fmt: skip


def v4_batch(dtype, block_size: int, rate: int, *, heads=4, dim=16, seqs=SEQS, seed=1) -> V4Batch:
    g = torch.Generator().manual_seed(seed)
    layout = ReferenceKVLayout(CPU, block_size=block_size)
    ring_spec = CacheSpec(CacheKind.SLIDING_WINDOW, dtype, 1, dim, window=WINDOW, rollback_slots=ROLLBACK)
    comp_spec = CacheSpec(CacheKind.PAGED, dtype, 1, dim, compress_rate=rate)
    num_blocks = sum(-(-n // block_size) for n, _, _ in seqs) + 3
    ring, compressed = layout.allocate(ring_spec, len(seqs) + 2), layout.allocate(comp_spec, num_blocks)
    for cache, spec in ((ring, ring_spec), (compressed, comp_spec)):  # stale and foreign entries: poison
        layout.write(cache, spec, torch.arange(cache.shape[0]), 30 * torch.randn(cache.shape, generator=g))
    free = torch.randperm(num_blocks, generator=g).tolist()
    seq_slots = torch.randperm(len(seqs) + 2, generator=g)[: len(seqs)]
    width = max(-(-n // block_size) for n, _, _ in seqs)
    tables, kv = [], []
    for (seq_len, q_len, since), slot in zip(seqs, seq_slots.tolist()):
        first = seq_len - q_len
        table = [free.pop() for _ in range(-(-seq_len // block_size))]
        tables.append(table + [-1] * (width - len(table)))
        earlier = torch.arange(max(since, first - ring_spec.ring_size), first)  # what the ring still holds
        ring_rows = ring_slots(slot, earlier, ring_spec.ring_size)
        layout.write(ring, ring_spec, ring_rows, torch.randn(len(earlier), 1, dim, generator=g))
        entries = torch.arange(seq_len // rate)
        comp_rows = compressed_slots(torch.tensor(table), entries, block_size, rate)
        layout.write(compressed, comp_spec, comp_rows, torch.randn(len(entries), 1, dim, generator=g))
        kv.append(torch.randn(q_len, dim, generator=g))
    tokens = sum(q for _, q, _ in seqs)
    meta = AttentionMetadata(
        torch.tensor([0] + [q for _, q, _ in seqs]).cumsum(0),
        torch.tensor([n for n, _, _ in seqs]),
        torch.tensor(tables),
        torch.zeros(tokens, dtype=torch.int64),  # unused by sparse_attention
        seq_slots=seq_slots,
        window_starts=torch.tensor([w for _, _, w in seqs]),
    )
    q = torch.randn(tokens, heads, dim, generator=g).to(dtype)
    return V4Batch(layout, ring_spec, comp_spec, ring, compressed, meta, q, torch.cat(kv).to(dtype))


def indices_for(batch: V4Batch, rate: int, top_k=6, seed=2) -> torch.Tensor:
    """[T, top_k] picks: visible entries, not yet visible ones, ones past the sequence's end, repeats, and -1."""
    visible = (batch.positions() + 1) // rate
    g = torch.Generator().manual_seed(seed)
    picks = (torch.rand(len(visible), top_k, generator=g) * (visible[:, None] + 3)).long()
    picks[:, -2] = picks[:, 0]  # a repeat counts once
    picks[torch.rand(len(visible), top_k, generator=g) < 0.25] = -1
    return picks


def kernel_attention(layout) -> NvidiaAttention:
    return NvidiaAttention(layout)


@dataclass(frozen=True, slots=True)
class Launch:
    """The kernel's launcher with `split_keys` keys per split, by one launch, in AttentionOps' shape."""

    block_size: int
    split_keys: int
    single_pass: bool

    def sparse_attention(self, q, kv, ring, ring_spec, meta, **kwargs) -> torch.Tensor:
        return sparse_attention.sparse_attention(
            q, kv, ring, ring_spec, meta, self.block_size, split_keys=self.split_keys, split=not self.single_pass,
            **kwargs,
        )  # fmt: skip


def assert_matches(out: torch.Tensor, expected: torch.Tensor, keys: int) -> None:
    assert out.shape == expected.shape and out.dtype == expected.dtype
    atol = 1e-5 * math.sqrt(keys)
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1.3e-6, atol=atol)
    else:  # the kernel rounds the softmax weights to bfloat16 for the value product; the reference does not
        ulp = torch.finfo(torch.bfloat16).eps * expected.float().abs().max().item()
        torch.testing.assert_close(out, expected, rtol=1.6e-2, atol=atol + ulp)


# ----------------------------------------------------------------------------- against the reference


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sink_scale", [0.5, 8.0], ids=["small_sinks", "large_sinks"])
@pytest.mark.parametrize("mode", ["window", "compressed", "indexed"])
@pytest.mark.parametrize("rates", RATES.values(), ids=RATES.keys())
def test_sparse_attention_matches_reference(rates, mode, sink_scale, dtype):
    block_size, rate = rates
    batch = v4_batch(dtype, block_size, rate)
    sinks = torch.randn(batch.q.shape[1], generator=torch.Generator().manual_seed(3)) * sink_scale
    indices = indices_for(batch, rate) if mode == "indexed" else None
    out = batch.attend(kernel_attention(batch.layout), mode, sinks, indices)
    expected = batch.attend(ReferenceAttention(batch.layout), mode, sinks, indices)
    if mode == "indexed":
        assert ((indices >= 0) & (indices >= ((batch.positions() + 1) // rate)[:, None])).any(), "invisible picks"
    assert_matches(out, expected, keys=WINDOW + max(n for n, _, _ in SEQS) // rate)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_padded_heads_and_dims_and_strided_q(dtype):
    """H = 20 (two head blocks, the second part padding) and D = 40 (a masked tail of the dims), q a view."""
    batch = v4_batch(dtype, 16, 4, heads=20, dim=40, seed=4)
    wide = torch.zeros(*batch.q.shape[:2], 48, dtype=dtype)
    wide[..., :40] = batch.q
    sinks = torch.randn(20, generator=torch.Generator().manual_seed(5))
    indices = indices_for(batch, 4)
    out = batch.attend(kernel_attention(batch.layout), "indexed", sinks, indices, q=wide[..., :40])
    expected = batch.attend(ReferenceAttention(batch.layout), "indexed", sinks, indices)
    assert_matches(out, expected, keys=WINDOW + max(n for n, _, _ in SEQS) // 4)


def test_what_the_kernel_cannot_read_is_refused_with_the_reason():
    """Caches of another dtype than q: a ValueError naming the op and what was passed (no fallback)."""
    batch = v4_batch(torch.float32, 16, 4)
    q = batch.q.to(torch.bfloat16)
    sinks = torch.randn(batch.q.shape[1], generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match=r"nvidia_sm100 sparse_attention: kv is torch.float32 and q torch.bfloat16"):
        batch.attend(NvidiaAttention(batch.layout), "compressed", sinks, q=q)


# ----------------------------------------------------------------------------- bitwise batch invariance


@pytest.mark.usefixtures("fixed_order_dot")
@pytest.mark.parametrize("mode", ["window", "indexed"])
def test_sequence_rows_bitwise_equal_alone_and_in_the_batch(mode):
    """A query's splits are its own: a sequence's rows do not depend on the other sequences of the step."""
    batch = v4_batch(torch.bfloat16, 16, 4)
    sinks = torch.randn(batch.q.shape[1], generator=torch.Generator().manual_seed(3))
    indices = indices_for(batch, 4) if mode == "indexed" else None
    nv = kernel_attention(batch.layout)
    full = batch.attend(nv, mode, sinks, indices)
    starts, meta = batch.meta.query_start_loc.tolist(), batch.meta
    for b in range(meta.num_seqs):
        rows = slice(starts[b], starts[b + 1])
        alone = AttentionMetadata(
            torch.tensor([0, rows.stop - rows.start]), meta.seq_lens[b : b + 1], meta.block_tables[b : b + 1],
            meta.slot_mapping[rows], seq_slots=meta.seq_slots[b : b + 1], window_starts=meta.window_starts[b : b + 1],
        )  # fmt: skip
        picks = None if indices is None else indices[rows]
        out = batch.attend(nv, mode, sinks, picks, q=batch.q[rows], kv=batch.kv[rows], meta=alone)
        assert torch.equal(out, full[rows]), b


# ----------------------------------------------------------------------------- splits of the keys

SPLIT = 4  # a full window of 8 is two splits, ending at a split's end; rate 4's 64 entries are 16


def indices_with_empty_splits(batch: V4Batch, rate: int, top_k=24) -> torch.Tensor:
    """indices_for's picks, and rows whose splits of SPLIT sorted picks hold nothing: -1 but for the last pick,
    one entry 13 times (a whole split of repeats), none visible yet but the last; and one row of -1 only."""
    picks = indices_for(batch, rate, top_k)
    visible = (batch.positions() + 1) // rate
    a, b, c, d = (visible >= 3).nonzero()[:4, 0].tolist()
    picks[a, :-1] = -1
    picks[b, :13] = visible[b] - 1
    picks[c, :-1] = visible[c] + torch.arange(top_k - 1)
    picks[d] = -1
    return picks


@pytest.mark.usefixtures("fixed_order_dot")
@pytest.mark.parametrize(
    "split_keys, dtype",
    [(SPLIT, torch.float32), (SPLIT, torch.bfloat16)],  # another split size: test_the_split_size_shows_in_the_bits
    ids=["4-f32", "4-bf16"],
)
@pytest.mark.parametrize("mode", ["window", "compressed", "indexed"])
def test_many_splits_match_reference_and_both_launches_agree_bitwise(mode, split_keys, dtype):
    """Windows of several splits, 16 splits of compressed entries or 6 of picks (some of -1, repeats or
    invisible entries only), keys ending on a split's end, a -inf sink: the reference's result, the same bits
    from the split launch as from the single pass."""
    batch = v4_batch(dtype, 16, 4)
    sinks = torch.randn(batch.q.shape[1], generator=torch.Generator().manual_seed(3))
    sinks[1] = float("-inf")
    indices = indices_with_empty_splits(batch, 4) if mode == "indexed" else None
    split = batch.attend(Launch(16, split_keys, single_pass=False), mode, sinks, indices)
    single = batch.attend(Launch(16, split_keys, single_pass=True), mode, sinks, indices)
    assert torch.equal(split, single)
    expected = batch.attend(ReferenceAttention(batch.layout), mode, sinks, indices)
    assert_matches(split, expected, keys=WINDOW + max(n for n, _, _ in SEQS) // 4)
    visible = (batch.positions() + 1) // 4
    assert ((visible > 0) & (visible % split_keys == 0)).any(), "no entries ending on a split's end"


@pytest.mark.usefixtures("fixed_order_dot")
@pytest.mark.parametrize("mode", ["window", "compressed", "indexed"])
def test_sequence_rows_bitwise_equal_alone_by_splits_and_in_the_batch_by_either_launch(mode):
    """A sequence alone takes the split launch (its block table cut to its own blocks: fewer splits in the grid),
    and the step's batch may take the single pass (the launch follows T): its rows are the same bits. The next
    test shows that a split size that followed the batch would fail this. In float32: bfloat16's rounding of
    the output would hide most differences of the fold's float32 rounding."""
    batch = v4_batch(torch.float32, 16, 4)
    sinks = torch.randn(batch.q.shape[1], generator=torch.Generator().manual_seed(3))
    indices = indices_with_empty_splits(batch, 4) if mode == "indexed" else None
    full = {single: batch.attend(Launch(16, SPLIT, single), mode, sinks, indices) for single in (False, True)}
    assert torch.equal(full[False], full[True])
    starts, meta = batch.meta.query_start_loc.tolist(), batch.meta
    for b, seq_len in enumerate(meta.seq_lens.tolist()):
        rows, table = slice(starts[b], starts[b + 1]), meta.block_tables[b : b + 1, : -(-seq_len // 16)]
        alone = AttentionMetadata(
            torch.tensor([0, rows.stop - rows.start]), meta.seq_lens[b : b + 1], table,
            meta.slot_mapping[rows], seq_slots=meta.seq_slots[b : b + 1], window_starts=meta.window_starts[b : b + 1],
        )  # fmt: skip
        picks = None if indices is None else indices[rows]
        split = Launch(16, SPLIT, single_pass=False)
        out = batch.attend(split, mode, sinks, picks, q=batch.q[rows], kv=batch.kv[rows], meta=alone)
        assert torch.equal(out, full[True][rows]), b


@pytest.mark.usefixtures("fixed_order_dot")
def test_the_split_size_shows_in_the_bits():
    """Negative control: were the split size chosen by the batch, the test above would see other bits."""
    batch = v4_batch(torch.float32, 16, 4)
    sinks = torch.randn(batch.q.shape[1], generator=torch.Generator().manual_seed(3))
    small, large = (batch.attend(Launch(16, keys, False), "window", sinks) for keys in (SPLIT, 8))
    assert not torch.equal(small, large)
