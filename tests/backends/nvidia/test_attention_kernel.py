"""The paged attention kernel against ReferenceAttention, and bitwise invariant to prefill chunking and batch order."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from deepinfer_core.backend.ops import AttentionMetadata
from deepinfer_core.kv.layout import CacheKind, CacheSpec, paged_slots
from deepinfer_core.reference.attention import ReferenceAttention
from deepinfer_core.reference.kv import ReferenceKVLayout
from deepinfer_nvidia_sm100.kernels import attention
from deepinfer_nvidia_sm100.ops import NvidiaAttention

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]

CASES = {
    # MLA weight-absorbed: one latent entry (64 + 16 rope dims) for all 8 heads; values are its first 64 dims
    "mla": dict(heads=8, kv_heads=1, entry_dim=80, key_dim=80, value_dim=64, value_offset=0),
    # K | V side by side, two query heads per cached head
    "gqa": dict(heads=4, kv_heads=2, entry_dim=64, key_dim=32, value_dim=32, value_offset=32),
}


@dataclass(frozen=True, slots=True)
class PagedContext:
    """Sequences of random entries in shuffled blocks of a cache whose other slots all hold poison."""

    case: dict
    block_size: int
    layout: ReferenceKVLayout
    spec: CacheSpec
    cache: torch.Tensor  # [slots, Hkv, Dc]
    tables: list[list[int]]  # block ids per sequence
    entries: list[torch.Tensor]  # [L, Hkv, Dc] per sequence
    queries: list[torch.Tensor]  # [L, H, Dk] per sequence: the query of every position

    def write(self, seq: int, positions: range) -> None:
        slots = paged_slots(torch.tensor(self.tables[seq]), torch.tensor(positions), self.block_size)
        self.layout.write(self.cache, self.spec, slots, self.entries[seq][positions.start : positions.stop])

    def step(self, batch: list[tuple[int, int, int]]) -> tuple[torch.Tensor, AttentionMetadata]:
        """q [T, H, Dk] and metadata for a batch of (sequence, seq_len, q_len): its last q_len of seq_len tokens."""
        width = max(len(table) for table in self.tables)
        tables = [self.tables[seq] + [-1] * (width - len(self.tables[seq])) for seq, _, _ in batch]
        queries, slots = [], []
        for seq, seq_len, q_len in batch:
            positions = torch.arange(seq_len - q_len, seq_len)
            queries.append(self.queries[seq][positions])
            slots.append(paged_slots(torch.tensor(self.tables[seq]), positions, self.block_size))
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0] + [q_len for _, _, q_len in batch]).cumsum(0),
            seq_lens=torch.tensor([seq_len for _, seq_len, _ in batch]),
            block_tables=torch.tensor(tables),
            slot_mapping=torch.cat(slots),
        )
        return torch.cat(queries), meta

    def attend(self, backend, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        case = self.case
        return backend.paged_attention(
            q, self.cache, self.spec, meta,
            scale=case["key_dim"] ** -0.5, value_dim=case["value_dim"], value_offset=case["value_offset"],
        )  # fmt: skip


def paged_context(case: dict, dtype: torch.dtype, block_size: int, lengths: list[int], *, seed: int, written=True):
    """A PagedContext for sequences of `lengths` tokens, their entries written unless `written` is False."""
    g = torch.Generator().manual_seed(seed)
    spec = CacheSpec(kind=CacheKind.PAGED, dtype=dtype, num_heads=case["kv_heads"], head_dim=case["entry_dim"])
    layout = ReferenceKVLayout(CPU, block_size=block_size)
    num_blocks = sum(-(-length // block_size) for length in lengths) + 3  # spare blocks stay poison
    cache = layout.allocate(spec, num_blocks)
    poison = 30 * torch.randn(cache.shape, generator=g)  # reading any slot outside a context shows
    layout.write(cache, spec, torch.arange(cache.shape[0]), poison)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-length // block_size))] for length in lengths]
    entries = [torch.randn(n, case["kv_heads"], case["entry_dim"], generator=g).to(dtype) for n in lengths]
    queries = [torch.randn(n, case["heads"], case["key_dim"], generator=g).to(dtype) for n in lengths]
    ctx = PagedContext(case, block_size, layout, spec, cache, tables, entries, queries)
    if written:
        for seq, length in enumerate(lengths):
            ctx.write(seq, range(length))
    return ctx


# ----------------------------------------------------------------------------- against the reference

LENGTHS = [37, 50, 20, 33, 32]
# prefill over 2-3 blocks, a prefill chunk after cached context, no queries, decode, decode at a block's end
MIXED_BATCH = [(0, 37, 37), (1, 50, 7), (2, 20, 0), (3, 33, 1), (4, 32, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_paged_attention_matches_reference(case, block_size, dtype):
    ctx = paged_context(case, dtype, block_size, LENGTHS, seed=1)
    q, meta = ctx.step(MIXED_BATCH)
    padded = torch.zeros(q.shape[0], q.shape[1], q.shape[2] + 8, dtype=dtype)
    padded[..., : q.shape[2]] = q  # the model passes q as a view with a wider head stride
    out = ctx.attend(NvidiaAttention(ctx.layout), padded[..., : q.shape[2]], meta)
    expected = ctx.attend(ReferenceAttention(ctx.layout), q, meta)
    assert out.shape == expected.shape == (q.shape[0], case["heads"], case["value_dim"]) and out.dtype == dtype
    atol = 1e-5 * math.sqrt(max(LENGTHS))
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1.3e-6, atol=atol)
    else:  # the kernel rounds the softmax weights to bfloat16 for the value product; the reference does not
        ulp = torch.finfo(torch.bfloat16).eps * expected.float().abs().max().item()
        torch.testing.assert_close(out, expected, rtol=1.6e-2, atol=atol + ulp)


# ----------------------------------------------------------------------------- bitwise invariance
# A query's (query, head) rows sit at other places of the kernel's tile when the prefill is chunked or the batch
# changes; with the interpreter's dot summed in one fixed order (conftest.fixed_order_dot) their bits then depend
# only on the kernel's own key chunking and online softmax, not on how the CPU's BLAS rounds by place.

CHUNKS = [13, 20, 1, 1]


@pytest.mark.usefixtures("fixed_order_dot")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_chunked_prefill_bitwise_equals_one_prefill(case, dtype):
    ctx = paged_context(case, dtype, 16, [sum(CHUNKS)], seed=2, written=False)
    chunks, end = [], 0
    for size in CHUNKS:  # each chunk writes its tokens, then attends over them and the cached ones before
        ctx.write(0, range(end, end + size))
        end += size
        chunks.append(ctx.attend(NvidiaAttention(ctx.layout), *ctx.step([(0, end, size)])))
    whole = ctx.attend(NvidiaAttention(ctx.layout), *ctx.step([(0, end, end)]))
    assert torch.equal(torch.cat(chunks), whole)


# batches sharing (sequence, seq_len, q_len) rows, each at other places and beside other sequences
BATCHES = [
    [(0, 35, 35)],
    [(0, 35, 35), (1, 50, 1), (2, 20, 0)],
    [(1, 50, 7), (0, 35, 35), (3, 9, 9)],
    [(2, 20, 0), (3, 9, 3), (1, 50, 1), (0, 35, 35), (1, 50, 7)],
    [(3, 9, 3), (1, 50, 7), (2, 20, 20)],
]


@pytest.mark.usefixtures("fixed_order_dot")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_sequence_rows_bitwise_equal_at_any_place_in_the_batch(case, dtype):
    ctx = paged_context(case, dtype, 16, [35, 50, 20, 9], seed=3)
    seen: dict[tuple[int, int, int], torch.Tensor] = {}
    for batch in BATCHES:
        q, meta = ctx.step(batch)
        out = ctx.attend(NvidiaAttention(ctx.layout), q, meta)
        starts = meta.query_start_loc.tolist()
        for i, rows in enumerate(batch):
            mine = out[starts[i] : starts[i + 1]]
            if rows in seen:
                assert torch.equal(mine, seen[rows]), f"{rows} changed bits in batch {batch}"
            seen[rows] = mine
    assert len(seen) < sum(len(batch) for batch in BATCHES)  # rows really were compared across batches


@pytest.mark.usefixtures("fixed_order_dot")
def test_bitwise_check_catches_a_key_chunk_size_that_changes(monkeypatch):
    """With the GPU's key chunk (64, not the interpreter's 16) the online softmax rounds differently: had the
    chunking varied with the batch, the invariance tests above would fail."""
    ctx = paged_context(CASES["gqa"], torch.float32, 16, [35], seed=4)
    q, meta = ctx.step([(0, 35, 35)])
    interpreted = ctx.attend(NvidiaAttention(ctx.layout), q, meta)
    monkeypatch.setattr(attention, "INTERPRET", False)  # picks the GPU launch sizes; the interpreter still runs it
    gpu_chunks = ctx.attend(NvidiaAttention(ctx.layout), q, meta)
    torch.testing.assert_close(gpu_chunks, interpreted)
    assert not torch.equal(gpu_chunks, interpreted)
