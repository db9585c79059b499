"""DSpark's block attention (kernels.block_attention, a Triton kernel: here under Triton's interpreter) against
ReferenceAttention.block_attention, on CPU: ragged draft blocks over rings whose unseen slots hold poison, plain or
packed in V4.1's FP8 window format, with and without meta.max_query_len; a row's bits must not depend on the other
sequences of the step (batch-invariant mode and default alike: the kernel has one tiling)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from deepinfer_core.backend.ops import AttentionMetadata
from deepinfer_core.kv.formats import round_blocks
from deepinfer_core.kv.layout import CacheKind, CacheSpec, KVLayout, ring_slots
from deepinfer_core.kv.packed import PackedKVLayout
from deepinfer_core.reference.attention import ReferenceAttention
from deepinfer_core.reference.kv import ReferenceKVLayout
from deepinfer_nvidia_sm100.ops import NvidiaAttention

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]
HEADS, DIM, WINDOW, ROLLBACK = 4, 32, 8, 5  # a ring of 13 slots
WINDOW_FORMAT = "fp8_e4m3/pow2:32"
# (seq_len, block rows, window_start): no context, all of a block at position 0, a short context, a ring wrapped
# many times, window starts past first - WINDOW and at first (no context), a sequence with no rows
BLOCKS = [(1, 1, 0), (6, 6, 0), (10, 3, 0), (300, 5, 0), (131, 6, 0), (100, 4, 93), (20, 2, 18), (50, 0, 0)]
LONGEST = max(rows for _, rows, _ in BLOCKS)


@dataclasses.dataclass(frozen=True, slots=True)
class Draft:
    """One drafting step's inputs: ring entries only where a block may read them, poison everywhere else."""

    layout: KVLayout
    spec: CacheSpec
    ring: torch.Tensor
    meta: AttentionMetadata
    q: torch.Tensor  # [T, H, D]
    kv: torch.Tensor  # [T, D]
    sinks: torch.Tensor  # [H] float32

    def attend(self, attention, **overrides) -> torch.Tensor:
        args = dict(q=self.q, kv=self.kv, meta=self.meta) | overrides
        return attention.block_attention(
            args["q"], args["kv"], self.ring, self.spec, args["meta"], sinks=self.sinks, scale=DIM**-0.5
        )


def draft(layout: KVLayout, dtype: torch.dtype, stored_format: str = "", max_query_len: int | None = None) -> Draft:
    g = torch.Generator().manual_seed(0)
    spec = CacheSpec(CacheKind.SLIDING_WINDOW, dtype, 1, DIM, window=WINDOW, rollback_slots=ROLLBACK,
                     stored_format=stored_format)  # fmt: skip
    num_slots = len(BLOCKS) + 2  # two spare sequence slots: poison only
    ring = layout.allocate(spec, num_slots)
    rows = num_slots * spec.ring_size
    layout.write(ring, spec, torch.arange(rows), (30 * torch.randn(rows, 1, DIM, generator=g)).to(dtype))
    seq_slots = torch.randperm(num_slots, generator=g)[: len(BLOCKS)]
    kv = []
    for (seq_len, block_rows, start), slot in zip(BLOCKS, seq_slots.tolist()):
        entries = torch.randn(seq_len, 1, DIM, generator=g).to(dtype)
        entries = round_blocks(entries, stored_format) if stored_format else entries
        first = seq_len - block_rows
        seen = torch.arange(max(first - WINDOW, start, 0), first)
        layout.write(ring, spec, ring_slots(slot, seen, spec.ring_size), entries[seen])
        kv.append(entries[first:, 0])
    tokens = sum(block_rows for _, block_rows, _ in BLOCKS)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0] + [block_rows for _, block_rows, _ in BLOCKS]).cumsum(0),
        seq_lens=torch.tensor([seq_len for seq_len, _, _ in BLOCKS]),
        block_tables=torch.zeros(len(BLOCKS), 1, dtype=torch.int64),  # unused by block_attention
        slot_mapping=torch.zeros(tokens, dtype=torch.int64),  # nothing is written
        seq_slots=seq_slots,
        window_starts=torch.tensor([start for _, _, start in BLOCKS]),
        max_query_len=max_query_len,
    )
    q = torch.randn(tokens, HEADS, DIM, generator=g).to(dtype)
    return Draft(layout, spec, ring, meta, q, torch.cat(kv), torch.randn(HEADS, generator=g))


def assert_matches(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Within the conformance suite's tolerance for an average of WINDOW + LONGEST entries."""
    assert out.shape == expected.shape and out.dtype == expected.dtype
    atol = 1e-5 * math.sqrt(WINDOW + LONGEST)
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1.3e-6, atol=atol)
    else:
        ulp = torch.finfo(torch.bfloat16).eps * 4.5  # the entries' |max| is well under 4.5
        torch.testing.assert_close(out, expected, rtol=1.6e-2, atol=atol + ulp)


LAYOUTS = {"plain": (ReferenceKVLayout, ""), "fp8": (PackedKVLayout, WINDOW_FORMAT)}


@pytest.mark.parametrize("max_query_len", [None, LONGEST, LONGEST + 3], ids=["rows_unknown", "longest", "more"])
@pytest.mark.parametrize("ring", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_block_attention_matches_reference(dtype, ring, max_query_len):
    layout_type, stored_format = LAYOUTS[ring]
    step = draft(layout_type(CPU, 16), dtype, stored_format, max_query_len)
    before = step.ring.clone()
    out = step.attend(NvidiaAttention(step.layout))
    assert torch.equal(step.ring, before), "block_attention must not write the ring"
    assert_matches(out, step.attend(ReferenceAttention(step.layout)))


@pytest.mark.usefixtures("fixed_order_dot")
def test_rows_do_not_depend_on_the_batch():
    """Batch-invariant mode: each sequence alone gives its rows' bits in the step."""
    step = draft(ReferenceKVLayout(CPU, 16), torch.float32, max_query_len=LONGEST)
    attention = NvidiaAttention(step.layout, batch_invariant=True)
    full = step.attend(attention)
    assert_matches(full, step.attend(ReferenceAttention(step.layout)))
    meta, starts = step.meta, step.meta.query_start_loc.tolist()
    for b in range(meta.num_seqs):
        rows = slice(starts[b], starts[b + 1])
        if rows.start == rows.stop:
            continue
        alone = dataclasses.replace(
            meta, query_start_loc=torch.tensor([0, rows.stop - rows.start]), seq_lens=meta.seq_lens[b : b + 1],
            block_tables=meta.block_tables[b : b + 1], slot_mapping=meta.slot_mapping[rows],
            seq_slots=meta.seq_slots[b : b + 1], window_starts=meta.window_starts[b : b + 1],
        )  # fmt: skip
        assert torch.equal(step.attend(attention, q=step.q[rows], kv=step.kv[rows], meta=alone), full[rows]), b


def test_what_it_cannot_read_is_refused_with_the_reason():
    step = draft(ReferenceKVLayout(CPU, 16), torch.float32)
    with pytest.raises(ValueError, match=r"nvidia_sm100 block_attention: kv is torch.float32 and q torch.bfloat16"):
        step.attend(NvidiaAttention(step.layout), q=step.q.to(torch.bfloat16))
