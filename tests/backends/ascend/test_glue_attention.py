"""AscendAttention against ReferenceAttention: the same entries in an AscendKVLayout cache and in a
ReferenceKVLayout cache, ragged batches (a full prefill, a prefill chunk after cached context, a sequence
without queries, decodes at and past a block's end), 128-token blocks in shuffled block tables, every
other slot poisoned.

These are glue tests on CPU against a fake torch_npu written from its documentation — not evidence that the
backend runs on Ascend hardware. The profile tests add the documented size limits of Ascend 950
(aclnnFusedInferAttentionScoreV5) and of Atlas A2/A3 (torch_npu's npu_fused_infer_attention_score page).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from fake_torch_npu import DocViolation, FakeTorchNpu, expect_violation

from deepinfer_ascend950.attention import AscendAttention
from deepinfer_ascend950.kv import AscendKVLayout
from deepinfer_core.backend.ops import AttentionMetadata
from deepinfer_core.kv.layout import CacheKind, CacheSpec, paged_slots
from deepinfer_core.reference.attention import ReferenceAttention
from deepinfer_core.reference.kv import ReferenceKVLayout

CPU = torch.device("cpu")
BLOCK = 128  # the backend's only block size
DTYPES = [torch.float32, torch.bfloat16]

CASES = {
    # MLA weight-absorbed: one latent entry (64 + 16 rope dims) for all 8 heads; values are its first 64 dims
    "mla": dict(heads=8, kv_heads=1, entry_dim=80, parts=(64, 16), key_dim=80, value_dim=64, value_offset=0),
    # K | V side by side, two query heads per cached head
    "gqa": dict(heads=4, kv_heads=2, entry_dim=64, parts=(), key_dim=32, value_dim=32, value_offset=32),
}
LENGTHS = [300, 260, 50, 129, 128, 200]
# (sequence, seq_len, q_len): prefill over 3 blocks, a 40-token chunk after 220 cached, no queries, a decode just
# past a block boundary, a decode at a block's end, a 17-token chunk
MIXED_BATCH = [(0, 300, 300), (1, 260, 40), (2, 50, 0), (3, 129, 1), (4, 128, 1), (5, 200, 17)]


@dataclass
class Context:
    case: dict
    spec: CacheSpec
    ascend: AscendKVLayout
    ascend_cache: torch.Tensor
    reference: ReferenceKVLayout
    reference_cache: torch.Tensor
    tables: list[list[int]]
    queries: list[torch.Tensor]  # [L, H, Dk] per sequence

    def step(self, batch: list[tuple[int, int, int]]) -> tuple[torch.Tensor, AttentionMetadata]:
        width = max(len(self.tables[seq]) for seq, _, _ in batch) + 1  # a spare -1 column, as the engine pads
        tables = [self.tables[seq] + [-1] * (width - len(self.tables[seq])) for seq, _, _ in batch]
        queries, slots = [], []
        for seq, seq_len, q_len in batch:
            positions = torch.arange(seq_len - q_len, seq_len)
            queries.append(self.queries[seq][positions])
            slots.append(paged_slots(torch.tensor(self.tables[seq]), positions, BLOCK))
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0] + [q_len for _, _, q_len in batch]).cumsum(0),
            seq_lens=torch.tensor([seq_len for _, seq_len, _ in batch]),
            block_tables=torch.tensor(tables),
            slot_mapping=torch.cat(slots),
        )
        return torch.cat(queries), meta

    def attend(self, npu: FakeTorchNpu, q: torch.Tensor, meta: AttentionMetadata):
        case, kwargs = self.case, dict(scale=self.case["key_dim"] ** -0.5, value_dim=self.case["value_dim"])
        kwargs["value_offset"] = case["value_offset"]
        padded = torch.zeros(*q.shape[:2], q.shape[2] + 8, dtype=q.dtype)
        padded[..., : q.shape[2]] = q  # the model passes q as a view with a wider head stride
        out = AscendAttention(npu, self.ascend).paged_attention(
            padded[..., : q.shape[2]], self.ascend_cache, self.spec, meta, **kwargs
        )
        expected = ReferenceAttention(self.reference).paged_attention(
            q, self.reference_cache, self.spec, meta, **kwargs
        )
        return out, expected


def context(case: dict, dtype: torch.dtype, lengths: list[int], *, seed: int) -> Context:
    g = torch.Generator().manual_seed(seed)
    spec = CacheSpec(
        CacheKind.PAGED, dtype, num_heads=case["kv_heads"], head_dim=case["entry_dim"], parts=case["parts"]
    )
    num_blocks = sum(-(-n // BLOCK) for n in lengths) + 2  # spare blocks stay poison
    ascend, reference = AscendKVLayout(FakeTorchNpu(), CPU, BLOCK), ReferenceKVLayout(CPU, BLOCK)
    ascend_cache, reference_cache = ascend.allocate(spec, num_blocks), reference.allocate(spec, num_blocks)
    every_slot = torch.arange(num_blocks * BLOCK)
    poison = 30 * torch.randn(len(every_slot), case["kv_heads"], case["entry_dim"], generator=g)
    for layout, cache in ((ascend, ascend_cache), (reference, reference_cache)):
        layout.write(cache, spec, every_slot, poison)  # reading any slot outside a context shows
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // BLOCK))] for n in lengths]
    for table, n in zip(tables, lengths):
        entries = torch.randn(n, case["kv_heads"], case["entry_dim"], generator=g).to(dtype)
        slots = paged_slots(torch.tensor(table), torch.arange(n), BLOCK)
        ascend.write(ascend_cache, spec, slots, entries)
        reference.write(reference_cache, spec, slots, entries)
    queries = [torch.randn(n, case["heads"], case["key_dim"], generator=g).to(dtype) for n in lengths]
    return Context(case, spec, ascend, ascend_cache, reference, reference_cache, tables, queries)


def assert_matches(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, context_len: int) -> None:
    assert out.shape == expected.shape and out.dtype == expected.dtype == dtype
    atol = 1e-5 * math.sqrt(context_len)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=atol)
    else:  # both round once from float32; only the float32 summation order differs
        ulp = torch.finfo(torch.bfloat16).eps * expected.float().abs().max().item()
        torch.testing.assert_close(out.float(), expected.float(), rtol=1e-2, atol=atol + ulp)


def fake(dtype: torch.dtype, profile: str | None = None) -> FakeTorchNpu:
    """bfloat16 runs on the documented dtypes; float32 needs the fake's (undocumented) relaxation."""
    return FakeTorchNpu(profile=profile, allow_float32_attention=dtype == torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CASES)
def test_paged_attention_matches_reference(name, dtype):
    ctx = context(CASES[name], dtype, LENGTHS, seed=1)
    npu = fake(dtype)
    out, expected = ctx.attend(npu, *ctx.step(MIXED_BATCH))
    assert_matches(out, expected, dtype, max(LENGTHS))
    [call] = npu.calls_of("npu_fused_infer_attention_score")
    args = call.args
    passed = [row for row in MIXED_BATCH if row[2] > 0]  # the sequence without queries is left out
    assert args["actual_seq_lengths"] == torch.tensor([q for _, _, q in passed]).cumsum(0).tolist()
    assert args["actual_seq_lengths_kv"] == [s for _, s, _ in passed]
    assert args["block_table"].tolist() == ctx.step(passed)[1].block_tables.tolist()
    assert (args["query_rope"] is not None) == (name == "mla")


@pytest.mark.parametrize("name", CASES)
def test_chunked_prefill_equals_one_prefill(name):
    """The same 200 tokens in chunks of 130, 1, 52, 17 (each after the ones before) or all at once."""
    ctx = context(CASES[name], torch.float32, [200], seed=2)
    npu = fake(torch.float32)
    chunks, end = [], 0
    for size in (130, 1, 52, 17):
        end += size
        out, expected = ctx.attend(npu, *ctx.step([(0, end, size)]))
        assert_matches(out, expected, torch.float32, end)
        chunks.append(out)
    whole, _ = ctx.attend(npu, *ctx.step([(0, 200, 200)]))
    torch.testing.assert_close(torch.cat(chunks), whole, rtol=1e-5, atol=1e-5)


def test_a_batch_without_queries_makes_no_call():
    ctx = context(CASES["mla"], torch.bfloat16, [40, 9], seed=3)
    npu = fake(torch.bfloat16)
    q, meta = ctx.step([(0, 40, 0), (1, 9, 0)])
    out = AscendAttention(npu, ctx.ascend).paged_attention(q, ctx.ascend_cache, ctx.spec, meta, scale=0.1, value_dim=64)
    assert out.shape == (0, 8, 64) and not npu.calls


# ---------------------------------------------------------------------------------- documented size limits

# DeepSeek-V3 MLA per device: kv_lora_rank 512 + rope 64 in one latent head, 16 query heads (128 over 8 ranks)
MLA_V3 = dict(heads=16, kv_heads=1, entry_dim=576, parts=(512, 64), key_dim=576, value_dim=512, value_offset=0)
MLA_V3_32 = dict(MLA_V3, heads=32)  # Atlas A2/A3 take 32, 64 or 128 heads
GQA_128 = dict(heads=8, kv_heads=2, entry_dim=256, parts=(), key_dim=128, value_dim=128, value_offset=128)
SHORT_BATCH = [(0, 300, 16), (3, 129, 1), (2, 50, 0), (5, 200, 5)]  # every query run <= 16 tokens


@pytest.mark.parametrize(
    "case, batch",
    [(MLA_V3, MIXED_BATCH), (MLA_V3, [(3, 129, 1), (4, 128, 1)]), (GQA_128, MIXED_BATCH)],
    ids=["mla_mixed", "mla_decode_only", "gqa_head_dim_128"],
)
def test_within_ascend950_limits(case, batch):
    ctx = context(case, torch.bfloat16, LENGTHS, seed=4)
    out, expected = ctx.attend(fake(torch.bfloat16, "ascend950"), *ctx.step(batch))
    assert_matches(out, expected, torch.bfloat16, max(LENGTHS))


def test_mla_within_atlas_a2_a3_limits():
    ctx = context(MLA_V3_32, torch.bfloat16, LENGTHS, seed=5)
    out, expected = ctx.attend(fake(torch.bfloat16, "atlas_a2_a3"), *ctx.step(SHORT_BATCH))
    assert_matches(out, expected, torch.bfloat16, max(LENGTHS))


A2_A3 = (
    "documented limit the backend does not handle (a bug if it runs on Atlas A2/A3, the only products the "
    "npu_fused_infer_attention_score page lists; the Ascend 950 doc of aclnnFusedInferAttentionScoreV5 lifts it): "
)


@pytest.mark.xfail(
    strict=True,
    raises=DocViolation,
    reason=A2_A3 + "MLA (query D 512 with rope) takes 1-16 query tokens per sequence, but AscendAttention sends "
    "whole prefill chunks through the same call",
)
def test_mla_prefill_chunk_on_atlas_a2_a3():
    ctx = context(MLA_V3_32, torch.bfloat16, LENGTHS, seed=6)
    with expect_violation("1-16 query tokens"):
        ctx.attend(fake(torch.bfloat16, "atlas_a2_a3"), *ctx.step([(1, 260, 40), (3, 129, 1)]))


@pytest.mark.xfail(
    strict=True,
    raises=DocViolation,
    reason=A2_A3 + "MLA with Q_S 1 supports only sparse_mode 0 without a mask, but AscendAttention always passes "
    "sparse_mode 3 and the 2048 x 2048 mask, also for decode-only batches",
)
def test_mla_decode_only_on_atlas_a2_a3():
    ctx = context(MLA_V3_32, torch.bfloat16, LENGTHS, seed=7)
    with expect_violation("Q_S 1 supports only sparse_mode 0"):
        ctx.attend(fake(torch.bfloat16, "atlas_a2_a3"), *ctx.step([(3, 129, 1), (4, 128, 1)]))


@pytest.mark.xfail(
    strict=True,
    raises=DocViolation,
    reason=A2_A3 + "TND without rope (D != 512) does not support PageAttention, which AscendAttention's standard "
    "(non-MLA) path uses",
)
def test_gqa_on_atlas_a2_a3():
    ctx = context(GQA_128, torch.bfloat16, LENGTHS, seed=8)
    with expect_violation("does not support PageAttention"):
        ctx.attend(fake(torch.bfloat16, "atlas_a2_a3"), *ctx.step(SHORT_BATCH))
