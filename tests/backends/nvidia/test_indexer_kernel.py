"""The lightning indexer (kernels.indexer: indexer_topk, indexer_select) against ReferenceAttention, under Triton's
interpreter: ragged batches of prefills, chunks and decodes over a keys cache whose unread rows hold NaN or huge
poison, block tables with garbage and -1 past each sequence's blocks; the same entries (and blocks), in the same
order."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from deepinfer_core.backend.ops import AttentionMetadata
from deepinfer_core.kv.layout import CacheKind, CacheSpec, compressed_slots
from deepinfer_core.reference.attention import ReferenceAttention, _best_first
from deepinfer_core.reference.kv import ReferenceKVLayout
from deepinfer_nvidia_sm100.kernels import indexer
from deepinfer_nvidia_sm100.ops import NvidiaAttention

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]
TOP_K = 8
# (seq_len, q_len): a prefill, a chunk after context, no queries, a decode, fewer entries than TOP_K, a short
# prefill (its first query sees no entry at rates 4 and 2), a decode that sees none at rate 4, a long decode
SEQS = [(27, 27), (50, 6), (20, 0), (33, 1), (9, 2), (3, 3), (2, 1), (130, 1)]
# (KV block size in tokens, compress rate): V4's CSA rate 4, and V4.1's rates 2 and 1
RATES = {"rate4": (16, 4), "rate2": (8, 2), "rate1": (8, 1)}
GARBAGE = 2**40  # the block id after each sequence's blocks (then -1): keys read through it would fault


@dataclass(frozen=True, slots=True)
class IndexBatch:
    """One step's indexer inputs over a random keys cache in ReferenceKVLayout, every unowned row poisoned."""

    layout: ReferenceKVLayout
    spec: CacheSpec
    keys: torch.Tensor  # [rows, 1, Di]
    meta: AttentionMetadata
    q: torch.Tensor  # [T, Hi, Di]
    weights: torch.Tensor  # [T, Hi] float32

    def visible(self) -> torch.Tensor:
        """[T]: how many entries each query sees."""
        starts, lens = self.meta.query_start_loc.tolist(), self.meta.seq_lens.tolist()
        positions = torch.cat([torch.arange(n - (starts[b + 1] - starts[b]), n) for b, n in enumerate(lens)])
        return (positions + 1) // self.spec.compress_rate

    def topk(self, backend, top_k=TOP_K) -> torch.Tensor:
        return backend.indexer_topk(self.q, self.weights, self.keys, self.spec, self.meta, top_k=top_k, scale=0.3)

    def select(self, backend, within=None, block_size=1, top_blocks=0, top_k=TOP_K):
        return backend.indexer_select(
            self.q, self.weights, self.keys, self.spec, self.meta, top_k=top_k, scale=0.3,
            within=within, block_size=block_size, top_blocks=top_blocks,
        )  # fmt: skip


def index_batch(dtype, block_size=16, rate=4, *, heads=4, dim=16, seqs=SEQS, ties=False, seed=1) -> IndexBatch:
    """ties: q and keys share a large component, and most keys point against it (scores exactly 0, ties for
    the rule to break), some are all zero; else plain random values (scores distinct but for a few zeros)."""
    g = torch.Generator().manual_seed(seed)
    layout = ReferenceKVLayout(CPU, block_size=block_size)
    spec = CacheSpec(CacheKind.PAGED, dtype, 1, dim, compress_rate=rate)
    num_blocks = sum(-(-n // block_size) for n, _ in seqs) + 3
    keys = layout.allocate(spec, num_blocks)
    poison = 1e30 * torch.randn(keys.shape, generator=g).sign()
    poison[::3] = float("nan")
    layout.write(keys, spec, torch.arange(keys.shape[0]), poison)  # every row no sequence owns stays poisoned
    axis = torch.zeros(dim)
    axis[0] = 3.0 if ties else 0.0
    free = torch.randperm(num_blocks, generator=g).tolist()
    width = max(-(-n // block_size) for n, _ in seqs) + 2  # + columns no sequence uses
    tables = []
    for seq_len, _ in seqs:
        table = [free.pop() for _ in range(-(-seq_len // block_size))]
        tables.append(table + [GARBAGE] + [-1] * (width - len(table) - 1))
        count = seq_len // rate
        entries = axis + torch.randn(count, dim, generator=g) * (0.5 if ties else 1.0)
        if ties:
            entries[torch.rand(count, generator=g) < 0.7, 0] = -3.0  # q . k < 0 for every head: score 0
            entries[torch.rand(count, generator=g) < 0.1] = 0.0
        layout.write(keys, spec, compressed_slots(torch.tensor(table), torch.arange(count), block_size, rate),
                     entries[:, None, :])  # fmt: skip
    tokens = sum(q for _, q in seqs)
    meta = AttentionMetadata(
        torch.tensor([0] + [q for _, q in seqs]).cumsum(0),
        torch.tensor([n for n, _ in seqs]),
        torch.tensor(tables),
        torch.zeros(tokens, dtype=torch.int64),  # unused by the indexer
    )
    q = (axis + torch.randn(tokens, heads, dim, generator=g) * (0.5 if ties else 1.0)).to(dtype)
    weights = torch.randn(tokens, heads, generator=g)  # both signs: negative scores rank below the zeros
    return IndexBatch(layout, spec, keys, meta, q, weights)


def kernel_attention(layout) -> NvidiaAttention:
    return NvidiaAttention(layout)


def random_within(batch: IndexBatch, block_size: int, seed=5) -> torch.Tensor:
    """[T, 5] candidate block ids: visible blocks, not yet visible ones, ones past every entry, repeats and -1."""
    g = torch.Generator().manual_seed(seed)
    visible = batch.visible()
    within = (torch.rand(len(visible), 5, generator=g) * (visible[:, None] // block_size + 3)).long()
    within[:, -1] = within[:, 0]
    within[torch.rand(within.shape, generator=g) < 0.2] = -1
    return within


# ----------------------------------------------------------------------------- against the reference


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rates", RATES.values(), ids=RATES.keys())
def test_indexer_topk_matches_reference(rates, dtype):
    batch = index_batch(dtype, *rates)
    out = batch.topk(kernel_attention(batch.layout))
    expected = batch.topk(ReferenceAttention(batch.layout))
    assert out.shape == expected.shape and out.dtype == torch.int64
    assert torch.equal(out, expected)  # the same entries, best first
    visible = batch.visible()
    assert torch.equal((out >= 0).sum(dim=1), visible.clamp(max=TOP_K))
    if rates[1] > 1:  # the batch holds queries that see nothing, and ones that see fewer than TOP_K entries
        assert (visible == 0).any() and ((visible > 0) & (visible < TOP_K)).any()


SELECTS = {  # (candidate block size, top_blocks, restricted to listed blocks)
    "index": (1, 0, False),
    "candidate_source": (3, 2, False),  # 3 does not divide the entry slots: a padded last block
    "every_block": (4, 64, False),  # more blocks asked for than any query has
    "reindex": (3, 0, True),
    "reindex_and_blocks": (2, 3, True),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("use", SELECTS.values(), ids=SELECTS.keys())
def test_indexer_select_matches_reference(use, dtype):
    block_size, top_blocks, restricted = use
    batch = index_batch(dtype, 8, 2, seed=2)
    within = random_within(batch, block_size) if restricted else None
    indices, blocks = batch.select(kernel_attention(batch.layout), within, block_size, top_blocks)
    want_indices, want_blocks = batch.select(ReferenceAttention(batch.layout), within, block_size, top_blocks)
    assert torch.equal(indices, want_indices)
    if top_blocks:
        assert blocks.dtype == torch.int64 and torch.equal(blocks, want_blocks)
    else:
        assert blocks is None and want_blocks is None
    if restricted:
        assert not torch.equal(indices, batch.select(ReferenceAttention(batch.layout), None, block_size)[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_heads_not_a_power_of_two_more_than_a_tile_and_a_strided_q(dtype):
    """Hi = 5 and Di = 24 (padded tiles), Hi = 70 (two head tiles of 64), q a view of a wider tensor."""
    for heads, dim in ((5, 24), (70, 16)):
        batch = index_batch(dtype, heads=heads, dim=dim, seqs=SEQS[:5], seed=3)
        wide = torch.zeros(*batch.q.shape[:2], dim + 8, dtype=dtype)
        wide[..., :dim] = batch.q
        strided = IndexBatch(batch.layout, batch.spec, batch.keys, batch.meta, wide[..., :dim], batch.weights)
        assert torch.equal(strided.topk(kernel_attention(batch.layout)), batch.topk(ReferenceAttention(batch.layout)))


def test_scores_match_the_reference_and_are_minus_inf_exactly_where_not_visible():
    batch = index_batch(torch.float32)
    scores, visible = indexer.index_scores(
        batch.q, batch.weights, batch.keys, batch.spec, batch.meta, batch.layout.block_size, scale=0.3
    )
    slots = batch.meta.block_tables.shape[1] * batch.spec.entries_per_block(batch.layout.block_size)
    assert scores.shape == (batch.q.shape[0], slots) and torch.equal(visible, batch.visible())
    assert torch.equal(scores == float("-inf"), torch.arange(slots)[None, :] >= visible[:, None])
    assert not scores[scores == 0].signbit().any(), "zeros must be +0.0 (the tie rule compares bits)"
    reference, starts = ReferenceAttention(batch.layout), batch.meta.query_start_loc.tolist()
    for b, seq_len in enumerate(batch.meta.seq_lens.tolist()):
        rows = range(starts[b], starts[b + 1])
        if len(rows):
            want, _ = reference._index_scores(batch.q, batch.weights, batch.keys, batch.spec, batch.meta, b,
                                              seq_len, rows, 0.3)  # fmt: skip
            torch.testing.assert_close(scores[rows.start : rows.stop, : want.shape[1]], want, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- ties and negative controls


def higher_entry_first(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The wrong tie rule: equal scores to the HIGHER column."""
    return scores.shape[1] - 1 - _best_first(scores.flip(1), k)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ties_go_to_the_lower_entry_and_block(dtype):
    """Most scores are exactly 0 (ReLU), so the tie rule decides; the wrong rule would choose other entries."""
    batch = index_batch(dtype, ties=True, seed=4)
    nv, reference = kernel_attention(batch.layout), ReferenceAttention(batch.layout)
    expected = batch.topk(reference)
    assert torch.equal(batch.topk(nv), expected)
    indices, blocks = batch.select(nv, block_size=2, top_blocks=4)
    want_indices, want_blocks = batch.select(reference, block_size=2, top_blocks=4)
    assert torch.equal(indices, want_indices) and torch.equal(blocks, want_blocks)

    # negative control: with ties broken to the higher entry (or block) the picks differ
    scores, visible = indexer.index_scores(batch.q, batch.weights, batch.keys, batch.spec, batch.meta, 16, scale=0.3)
    wrong = higher_entry_first(scores, TOP_K)
    assert not torch.equal(torch.where(wrong < visible[:, None], wrong, -1), expected)
    block_scores = scores.view(scores.shape[0], -1, 2).amax(dim=-1)
    assert not torch.equal(higher_entry_first(block_scores, 4)[:, 1:], _best_first(block_scores, 4)[:, 1:])


def test_a_minus_zero_would_break_the_tie_rule():
    """Why the kernel stores +0.0: the int64 keys order -0.0 below +0.0, a float sort does not."""
    scores = torch.tensor([[-0.0, 0.0, -1.0]])
    assert _best_first(scores, 2).tolist() == [[0, 1]]  # the reference: equal, the lower entry first
    assert indexer._best_first(scores, 2).tolist() == [[1, 0]]
    assert indexer._best_first(scores + 0.0, 2).tolist() == [[0, 1]]


def test_a_visibility_off_by_one_would_be_caught():
    """The batch's top-k changes if a query also saw entry (pos + 1) // rate, or missed its newest entry."""
    batch = index_batch(torch.float32)
    expected = batch.topk(ReferenceAttention(batch.layout))
    visible = batch.visible()
    rows, starts = [], batch.meta.query_start_loc.tolist()
    slots = batch.meta.block_tables.shape[1] * 4
    for b, seq_len in enumerate(batch.meta.seq_lens.tolist()):  # each query's scores over all its entries
        count = seq_len // 4
        rows_of = compressed_slots(batch.meta.block_tables[b], torch.arange(count), 16, 4)
        keys = batch.keys[rows_of, 0]  # [count, Di]
        for t in range(starts[b], starts[b + 1]):
            per_head = torch.relu(batch.q[t] @ keys.t()) * 0.3 * batch.weights[t][:, None]  # [Hi, count]
            rows.append(torch.nn.functional.pad(per_head.sum(0), (0, slots - count), value=float("-inf")))
    unmasked = torch.stack(rows)  # [T, C]
    for shift in (1, -1):
        seen = torch.arange(slots)[None, :] < (visible + shift)[:, None]
        wrong = indexer._picked(unmasked.masked_fill(~seen, float("-inf")), TOP_K)
        assert not torch.equal(wrong, expected), shift
    right = torch.arange(slots)[None, :] < visible[:, None]
    assert torch.equal(indexer._picked(unmasked.masked_fill(~right, float("-inf")), TOP_K), expected)


# ----------------------------------------------------------------------------- batching, host reads, refusals


def test_a_sequence_chooses_the_same_alone_and_in_the_batch():
    """A query's scores come from its own row and metadata: the same bits with fewer sequences and a narrower
    block table (a smaller bound C)."""
    batch = index_batch(torch.bfloat16, seed=6)
    nv, meta, starts = kernel_attention(batch.layout), batch.meta, batch.meta.query_start_loc.tolist()
    full, _ = indexer.index_scores(batch.q, batch.weights, batch.keys, batch.spec, meta, 16, scale=0.3)
    picks = batch.topk(nv)
    for b in (0, 1, 3):
        rows = slice(starts[b], starts[b + 1])
        width = -(-int(meta.seq_lens[b]) // 16)
        alone_meta = AttentionMetadata(torch.tensor([0, rows.stop - rows.start]), meta.seq_lens[b : b + 1],
                                       meta.block_tables[b : b + 1, :width], meta.slot_mapping[rows])  # fmt: skip
        alone = IndexBatch(batch.layout, batch.spec, batch.keys, alone_meta, batch.q[rows], batch.weights[rows])
        scores, _ = indexer.index_scores(alone.q, alone.weights, alone.keys, alone.spec, alone_meta, 16, scale=0.3)
        assert torch.equal(scores, full[rows, : scores.shape[1]]), b
        assert torch.equal(alone.topk(nv), picks[rows]), b


def test_no_host_reads_around_the_kernel(monkeypatch):
    """The torch ops around the kernel (the metadata, the top-k's) run on "meta" tensors, which have no values:
    nothing reads one on the host, nothing is shaped by one."""
    batch = index_batch(torch.float32)
    tokens, slots = batch.q.shape[0], batch.meta.block_tables.shape[1] * 4
    on_meta = torch.device("meta")
    scores = torch.empty(tokens, slots, device=on_meta)
    visible = torch.empty(tokens, dtype=torch.int64, device=on_meta)
    monkeypatch.setattr(indexer, "index_scores", lambda *args, **kwargs: (scores, visible))
    args = (batch.q.to(on_meta), batch.weights.to(on_meta), batch.keys.to(on_meta), batch.spec, None, 16)
    within = torch.empty(tokens, 5, dtype=torch.int64, device=on_meta)
    indices, blocks = indexer.indexer_select(*args, top_k=TOP_K, scale=0.3, within=within, candidate_block=3,
                                             top_blocks=3)  # fmt: skip
    assert indices.shape == (tokens, TOP_K) and blocks.shape == (tokens, 3) and indices.is_meta
    assert indexer.indexer_topk(*args, top_k=TOP_K, scale=0.3).shape == (tokens, TOP_K)
    meta = batch.meta
    tok = indexer.token_metadata(
        AttentionMetadata(meta.query_start_loc.to(on_meta), meta.seq_lens.to(on_meta), meta.block_tables, None),
        tokens,
    )
    assert tok.shape == (4, tokens) and tok.is_meta


def test_the_top_k_in_row_chunks(monkeypatch):
    """A long prefill's top-k goes a few rows at a time (bounded int64 keys): the same picks."""
    batch = index_batch(torch.float32, seed=7)
    monkeypatch.setattr(indexer, "KEY_ROWS_ELEMENTS", 100)  # 2 rows of 44 slots at a time
    within = random_within(batch, 2)
    indices, blocks = batch.select(kernel_attention(batch.layout), within, 2, 3)
    want_indices, want_blocks = batch.select(ReferenceAttention(batch.layout), within, 2, 3)
    assert torch.equal(indices, want_indices) and torch.equal(blocks, want_blocks)


def test_no_queries():
    batch = index_batch(torch.float32, seqs=[(20, 0), (0, 0)])
    assert batch.topk(kernel_attention(batch.layout)).shape == (0, TOP_K)
    indices, blocks = batch.select(kernel_attention(batch.layout), torch.empty(0, 2, dtype=torch.int64), 4, 3)
    assert indices.shape == (0, TOP_K) and blocks.shape == (0, 3)


def test_what_the_kernels_cannot_read_is_refused_with_the_reason():
    """Keys of another dtype than q, and keys of two heads: a ValueError naming the op and what was passed
    (nothing falls back to the reference's PyTorch code)."""
    batch = index_batch(torch.float32)
    nv = NvidiaAttention(batch.layout)
    mixed = IndexBatch(batch.layout, batch.spec, batch.keys, batch.meta, batch.q.to(torch.bfloat16), batch.weights)
    with pytest.raises(ValueError, match=r"nvidia_sm100 indexer_topk: keys is torch.float32 and q torch.bfloat16"):
        mixed.topk(nv)
    with pytest.raises(ValueError, match="nvidia_sm100 indexer_select: keys is torch.float32"):
        mixed.select(nv, random_within(batch, 2), 2, 3)
    two_heads = dataclasses.replace(batch.spec, num_heads=2)
    with pytest.raises(ValueError, match="one head"):
        IndexBatch(batch.layout, two_heads, batch.keys, batch.meta, batch.q, batch.weights).topk(nv)
