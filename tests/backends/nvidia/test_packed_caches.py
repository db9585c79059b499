"""DeepSeek-V4.1's caches stored packed (PackedKVLayout: window FP8, compressed entries and indexer keys FP4), read
by the sparse attention and indexer kernels under Triton's interpreter: the same bits as the kernels reading the
same rounded values from plain bfloat16 / float32 rows (the decode in registers is exact), by both attention
launches; and within the reference's tolerance of ReferenceAttention reading the packed caches through gather."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.backend.ops import AttentionMetadata
from deepinfer_core.kv.formats import pack, round_blocks, unpack
from deepinfer_core.kv.layout import CacheKind, CacheSpec, compressed_slots, ring_slots
from deepinfer_core.kv.packed import PackedKVLayout
from deepinfer_core.reference.attention import ReferenceAttention
from deepinfer_core.reference.kv import ReferenceKVLayout
from deepinfer_nvidia_sm100.kernels import indexer, sparse_attention
from deepinfer_nvidia_sm100.kernels import packed as packed_kernels
from deepinfer_nvidia_sm100.kernels.packed import stage_blocks, stage_ring
from deepinfer_nvidia_sm100.kv import NvidiaKVLayout
from deepinfer_nvidia_sm100.ops import NvidiaAttention

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]
BLOCK_SIZE, RATE, DIM, INDEX_DIM = 16, 2, 32, 32
WINDOW, ROLLBACK = 8, 6
WINDOW_FORMAT, ENTRY_FORMAT, INDEX_FORMAT = "fp8_e4m3/pow2:32", "fp4_e2m1/e4m3:16", "fp4_e2m1/pow2:32"
# (seq_len, q_len): a prefill past the ring, a chunk after context, a decode, a long decode
SEQS = [(27, 27), (50, 6), (33, 1), (90, 1)]


def specs(dtype, packed: bool) -> dict[str, CacheSpec]:
    def fmt(name: str) -> str:
        return name if packed else ""

    return {
        "window": CacheSpec(CacheKind.SLIDING_WINDOW, dtype, 1, DIM, window=WINDOW, rollback_slots=ROLLBACK,
                            stored_format=fmt(WINDOW_FORMAT)),
        "compressed": CacheSpec(CacheKind.PAGED, dtype, 1, DIM, compress_rate=RATE, stored_format=fmt(ENTRY_FORMAT)),
        "index_keys": CacheSpec(CacheKind.PAGED, dtype, 1, INDEX_DIM, compress_rate=RATE,
                                stored_format=fmt(INDEX_FORMAT)),
    }  # fmt: skip


def spread(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """x with rows scaled by 10^-4 .. 10^1 and elements by 10^-5 .. 1: subnormal e4m3 elements and scales."""
    rows = 10 ** (torch.rand(x.shape[0], 1, 1, generator=g) * 5 - 4)
    return x * rows * 10 ** (-5 * torch.rand(x.shape, generator=g))


class Step:
    """One step's inputs over caches holding values already rounded to their formats, in both layouts."""

    def __init__(self, dtype, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        num_blocks = sum(-(-n // BLOCK_SIZE) for n, _ in SEQS) + 2
        seq_slots = torch.randperm(len(SEQS) + 1, generator=g)[: len(SEQS)]
        free = torch.randperm(num_blocks, generator=g).tolist()
        width = max(-(-n // BLOCK_SIZE) for n, _ in SEQS)
        writes = {name: ([], []) for name in ("window", "compressed", "index_keys")}  # slots, values per cache
        tables, kv = [], []
        for (seq_len, q_len), slot in zip(SEQS, seq_slots.tolist()):
            first = seq_len - q_len
            table = [free.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
            tables.append(table + [-1] * (width - len(table)))
            earlier = torch.arange(max(0, first - WINDOW - ROLLBACK), first)
            entries = compressed_slots(torch.tensor(table), torch.arange(seq_len // RATE), BLOCK_SIZE, RATE)
            for name, slots, dim, scale in (
                ("window", ring_slots(slot, earlier, WINDOW + ROLLBACK), DIM, 1.0),
                ("compressed", entries, DIM, 3.0),
                ("index_keys", entries, INDEX_DIM, 1.0),
            ):
                writes[name][0].append(slots)
                writes[name][1].append(spread(torch.randn(len(slots), 1, dim, generator=g) * scale, g))
            kv.append(torch.randn(q_len, DIM, generator=g))
        formats = {"window": WINDOW_FORMAT, "compressed": ENTRY_FORMAT, "index_keys": INDEX_FORMAT}
        self.writes = {
            name: (torch.cat(slots), round_blocks(torch.cat(values).to(dtype), formats[name]))
            for name, (slots, values) in writes.items()
        }
        self.num_blocks, self.num_slots = num_blocks, len(SEQS) + 1
        tokens = sum(q for _, q in SEQS)
        self.meta = AttentionMetadata(
            torch.tensor([0] + [q for _, q in SEQS]).cumsum(0),
            torch.tensor([n for n, _ in SEQS]),
            torch.tensor(tables),
            torch.zeros(tokens, dtype=torch.int64),
            seq_slots=seq_slots,
            window_starts=torch.zeros(len(SEQS), dtype=torch.int64),
        )
        self.q = torch.randn(tokens, 4, DIM, generator=g).to(dtype)
        self.kv = round_blocks(torch.cat(kv).to(dtype), WINDOW_FORMAT)
        self.index_q = round_blocks(torch.randn(tokens, 4, INDEX_DIM, generator=g).to(dtype), INDEX_FORMAT)
        self.index_weights = torch.randn(tokens, 4, generator=g)
        self.sinks = torch.randn(4, generator=g)
        self.indices = (torch.rand(tokens, 6, generator=g) * 50).long()

    def caches(self, layout, packed: bool) -> tuple[dict[str, CacheSpec], dict[str, torch.Tensor]]:
        """The caches, written through `layout` with or without the stored formats."""
        cache_specs, caches = specs(self.dtype, packed), {}
        for name, spec in cache_specs.items():
            caches[name] = layout.allocate(spec, self.num_slots if name == "window" else self.num_blocks)
            layout.write(caches[name], spec, *self.writes[name])
        return cache_specs, caches

    def attend(self, attention, packed: bool, **launch) -> torch.Tensor:
        cache_specs, caches = self.caches(attention.layout, packed)
        if launch:  # one launch, by the kernel's own entry point
            call = sparse_attention.sparse_attention
            return call(self.q, self.kv, caches["window"], cache_specs["window"], self.meta, BLOCK_SIZE,
                        sinks=self.sinks, scale=0.3, compressed=caches["compressed"],
                        compressed_spec=cache_specs["compressed"], indices=self.indices, **launch)  # fmt: skip
        return attention.sparse_attention(
            self.q, self.kv, caches["window"], cache_specs["window"], self.meta, sinks=self.sinks, scale=0.3,
            compressed=caches["compressed"], compressed_spec=cache_specs["compressed"], indices=self.indices,
        )  # fmt: skip

    def select(self, attention, packed: bool):
        cache_specs, caches = self.caches(attention.layout, packed)
        return attention.indexer_select(
            self.index_q, self.index_weights, caches["index_keys"], cache_specs["index_keys"], self.meta,
            top_k=5, scale=0.2, block_size=2, top_blocks=2,
        )  # fmt: skip


def test_the_packed_caches_are_packed():
    step = Step(torch.bfloat16)
    cache_specs, caches = step.caches(PackedKVLayout(CPU, BLOCK_SIZE), packed=True)
    assert all(t.dtype == torch.uint8 for t in caches.values())
    # bytes per entry: FP8 32 + 1 scale byte; FP4 16 + 2 (e4m3 per 16) or + 1 (e8m0 per 32); bf16 would be 64
    assert [t.shape[1] for t in caches.values()] == [33, 18, 17]


@pytest.mark.usefixtures("fixed_order_dot")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("stage", [False, True], ids=["in_registers", "staged"])
@pytest.mark.parametrize("single_pass", [False, True], ids=["split", "single_pass"])
def test_sparse_attention_reads_packed_caches_bit_for_bit(single_pass, stage, dtype):
    """Top-k picks of packed entries decoded in the kernel or staged (the ring is always staged)."""
    step = Step(dtype)
    launch = dict(split=not single_pass, split_keys=4, stage=stage)
    packed = step.attend(NvidiaAttention(PackedKVLayout(CPU, BLOCK_SIZE)), True, **launch)
    plain = step.attend(NvidiaAttention(ReferenceKVLayout(CPU, BLOCK_SIZE)), False, **launch)
    assert torch.equal(packed, plain)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sparse_attention_over_packed_caches_matches_the_reference(dtype):
    step = Step(dtype, seed=2)
    layout = PackedKVLayout(CPU, BLOCK_SIZE)
    out = step.attend(NvidiaAttention(layout), True)
    expected = step.attend(ReferenceAttention(layout), True)  # through gather: the canonical values
    tolerance = dict(rtol=1.3e-6, atol=1e-4) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=2e-2)
    torch.testing.assert_close(out, expected, **tolerance)


@pytest.mark.usefixtures("fixed_order_dot")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_indexer_reads_packed_keys_bit_for_bit(dtype):
    step = Step(dtype, seed=3)
    layout = PackedKVLayout(CPU, BLOCK_SIZE)
    packed_entries, packed_blocks = step.select(NvidiaAttention(layout), True)
    plain_entries, plain_blocks = step.select(NvidiaAttention(ReferenceKVLayout(CPU, BLOCK_SIZE)), False)
    assert torch.equal(packed_entries, plain_entries) and torch.equal(packed_blocks, plain_blocks)
    ref_entries, ref_blocks = step.select(ReferenceAttention(layout), True)
    assert torch.equal(packed_blocks, ref_blocks)  # block maxima: robust to the scores' rounding here
    assert (packed_entries >= 0).sum() == (ref_entries >= 0).sum()


@pytest.mark.usefixtures("fixed_order_dot")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_index_scores_from_staged_and_in_register_keys_are_the_same_bits(dtype):
    step = Step(dtype, seed=4)
    packed_specs, packed_caches = step.caches(PackedKVLayout(CPU, BLOCK_SIZE), packed=True)
    plain_specs, plain = step.caches(ReferenceKVLayout(CPU, BLOCK_SIZE), packed=False)
    inputs = (step.index_q, step.index_weights)

    def scores(caches, cache_specs, **stage):
        keys, spec = caches["index_keys"], cache_specs["index_keys"]
        return indexer.index_scores(*inputs, keys, spec, step.meta, BLOCK_SIZE, scale=0.2, **stage)[0]

    expected = scores(plain, plain_specs)
    assert expected.isfinite().any() and expected.isinf().any()  # seen and unseen entries
    for stage in (False, True):
        assert torch.equal(scores(packed_caches, packed_specs, stage=stage), expected), stage


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_staging_decodes_the_steps_rows_as_kv_formats_does(dtype):
    """stage_ring: every ring row of the step's sequences, sequence b's at slot b; stage_blocks: every block of
    the block tables, -1 kept -1. Values: kv.formats.unpack's, in the compute dtype."""
    step = Step(dtype, seed=5)
    cache_specs, caches = step.caches(PackedKVLayout(CPU, BLOCK_SIZE), packed=True)
    window, ring = cache_specs["window"], caches["window"]
    staged, slots = stage_ring(ring, window, step.meta.seq_slots, dtype)
    assert torch.equal(slots, torch.arange(len(SEQS)))
    for b, slot in enumerate(step.meta.seq_slots.tolist()):
        rows = ring[slot * window.ring_size : (slot + 1) * window.ring_size]
        expected = unpack(rows, WINDOW_FORMAT, dtype)
        assert torch.equal(staged[b * window.ring_size : (b + 1) * window.ring_size], expected), b
    spec, entries = cache_specs["compressed"], caches["compressed"]
    per_block = spec.entries_per_block(BLOCK_SIZE)
    staged, tables = stage_blocks(entries, spec, step.meta.block_tables, per_block, dtype)
    assert torch.equal(tables < 0, step.meta.block_tables < 0)
    for block, new in zip(step.meta.block_tables.flatten().tolist(), tables.flatten().tolist()):
        if block >= 0:
            expected = unpack(entries[block * per_block : (block + 1) * per_block], ENTRY_FORMAT, dtype)
            assert torch.equal(staged[new * per_block : (new + 1) * per_block], expected), block


@pytest.mark.parametrize(
    "batch_invariant, max_bytes", [(False, None), (True, None), (False, 0)], ids=["default", "batch_invariant", "cap"]
)
def test_the_batch_invariant_mode_never_stages_by_shapes(batch_invariant, max_bytes, monkeypatch):
    """Default mode: this step's top-k picks and (a prefill's) index keys are staged, as their shapes make
    cheaper, unless the scratch would pass STAGE_MAX_BYTES; batch-invariant mode: decoded in the kernels
    whatever the shapes (staged or not may round differently on a GPU). The ring is staged in every case."""
    if max_bytes is not None:
        monkeypatch.setattr(packed_kernels, "STAGE_MAX_BYTES", max_bytes)
    staged = []

    def counting(cache, spec, *args):
        staged.append(spec.stored_format)
        return stage_blocks(cache, spec, *args)

    monkeypatch.setattr(sparse_attention, "stage_blocks", counting)
    monkeypatch.setattr(indexer, "stage_blocks", counting)
    step = Step(torch.float32)
    attention = NvidiaAttention(PackedKVLayout(CPU, BLOCK_SIZE), batch_invariant)
    step.attend(attention, True)
    step.select(attention, True)
    assert staged == ([] if batch_invariant or max_bytes == 0 else [ENTRY_FORMAT, INDEX_FORMAT])


def test_packed_rows_of_another_width_are_refused_with_the_reason():
    step = Step(torch.bfloat16)
    attention = NvidiaAttention(PackedKVLayout(CPU, BLOCK_SIZE))
    cache_specs, caches = step.caches(attention.layout, packed=True)
    narrow = caches["window"][:, :-1]
    with pytest.raises(ValueError, match=r"nvidia_sm100 sparse_attention: ring holds packed rows \(32,\)"):
        attention.sparse_attention(step.q, step.kv, narrow, cache_specs["window"], step.meta, sinks=step.sinks,
                                   scale=0.3)  # fmt: skip


class BlockedRows(PackedKVLayout):
    """A layout whose slots are not rows (say, a head-major one): it does not promise slot_is_row."""

    slot_is_row = False


def test_a_layout_without_one_row_per_slot_is_refused_with_the_reason():
    step = Step(torch.bfloat16)
    attention = NvidiaAttention(BlockedRows(CPU, BLOCK_SIZE))
    cache_specs, caches = step.caches(PackedKVLayout(CPU, BLOCK_SIZE), packed=True)
    with pytest.raises(ValueError, match=r"the KV layout is BlockedRows, not one row per slot"):
        attention.sparse_attention(step.q, step.kv, caches["window"], cache_specs["window"], step.meta,
                                   sinks=step.sinks, scale=0.3)  # fmt: skip


# ----------------------------------------------------------------------------- writing packed rows


def pack_inputs(rows: int, dim: int, seed: int) -> torch.Tensor:
    """Every magnitude a block meets (1e-26 .. 1e8 by row, a zero row, one below every scale's floor, mixed
    magnitudes within a block) and a block whose subnormal e4m3 scale needs kv.formats.pack's amax / 4. No
    float32 subnormals: Triton's interpreter widens bfloat16 ones wrongly (a GPU does not)."""
    g = torch.Generator().manual_seed(seed)
    x = spread(torch.randn(rows, 1, dim, generator=g), g)[:, 0] * torch.logspace(-26, 8, rows)[:, None]
    x[0], x[1] = 0.0, torch.randn(dim, generator=g).sign() * (1.2e-38 + 5e-38 * torch.rand(dim, generator=g))
    x[2] = torch.randn(dim, generator=g) * torch.logspace(-6, 6, dim)
    x[3, :16], x[3, 1:16:2] = 0.0176, -0.004
    return x


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide")  # a zero block's amax / 4, as in torch
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", [WINDOW_FORMAT, ENTRY_FORMAT, INDEX_FORMAT])
def test_the_write_kernel_stores_the_bytes_of_kv_formats(fmt, dtype):
    """NvidiaKVLayout.write (kernels.rounding.pack_rows) against core's kv.formats.pack, byte for byte: values
    already in the format (what V4.1 writes) and raw ones, at scattered slots of a cache of another width."""
    kind = CacheKind.SLIDING_WINDOW if fmt == WINDOW_FORMAT else CacheKind.PAGED
    spec = CacheSpec(kind, dtype, 1, 64, window=8 if kind is CacheKind.SLIDING_WINDOW else 0, stored_format=fmt)
    layout = NvidiaKVLayout(CPU, BLOCK_SIZE)
    for seed, rounded in ((1, True), (2, False)):
        x = pack_inputs(40, 64, seed).to(dtype)
        values = round_blocks(x, fmt) if rounded else x
        cache = layout.allocate(spec, 6)  # 48 or 96 rows
        slots = torch.randperm(cache.shape[0], generator=torch.Generator().manual_seed(seed))[:40]
        layout.write(cache, spec, slots, values[:, None, :])
        assert torch.equal(cache[slots], pack(values, fmt)), (seed, rounded)
        untouched = torch.ones(cache.shape[0], dtype=torch.bool)
        untouched[slots] = False
        assert not cache[untouched].any()
