"""On a GPU only (skipped elsewhere): the sparse attention kernel's two launches (split over the context, and
the single pass) give the same bits at DeepSeek-V4 Flash's shapes, compiled for the GPU (the interpreter tests
show it for the interpreter's arithmetic only), and agree with the reference."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from deepinfer_core.backend.ops import AttentionMetadata  # noqa: E402
from deepinfer_core.kv.layout import CacheKind, CacheSpec  # noqa: E402
from deepinfer_core.reference.attention import ReferenceAttention  # noqa: E402
from deepinfer_core.reference.kv import ReferenceKVLayout  # noqa: E402
from deepinfer_nvidia_sm100.kernels import sparse_attention  # noqa: E402

HEADS, DIM, WINDOW, RING, BLOCK, TOP_K = 64, 512, 128, 134, 128, 512
CONTEXTS = [3000, 700, 129, 5]  # decode queries: long, medium, one past the window, short


def _step(rate: int, indexed: bool, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(rate)
    batch = len(CONTEXTS)
    per_block = BLOCK // rate
    width = -(-max(CONTEXTS) // BLOCK)
    tables = torch.arange(batch * width, device="cuda").view(batch, width)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, device="cuda"),
        seq_lens=torch.tensor(CONTEXTS, device="cuda"),
        block_tables=tables,
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device="cuda"),
        seq_slots=torch.arange(batch, device="cuda"),
        window_starts=torch.zeros(batch, dtype=torch.int64, device="cuda"),
        cached_lens=torch.zeros(batch, dtype=torch.int64, device="cuda"),
    )
    ring = torch.randn(batch * RING, 1, DIM, generator=g, device="cuda").to(dtype)
    compressed = torch.randn(batch * width * per_block, 1, DIM, generator=g, device="cuda").to(dtype)
    q = torch.randn(batch, HEADS, DIM, generator=g, device="cuda").to(dtype)
    kv = torch.randn(batch, DIM, generator=g, device="cuda").to(dtype)
    sinks = torch.randn(HEADS, generator=g, device="cuda")
    indices = None
    if indexed:
        visible = torch.tensor(CONTEXTS, device="cuda") // rate
        indices = (torch.rand(batch, TOP_K, generator=g, device="cuda") * (visible[:, None] + 2)).long()
        indices[:, ::7] = -1
    ring_spec = CacheSpec(CacheKind.SLIDING_WINDOW, dtype, 1, DIM, window=WINDOW, rollback_slots=RING - WINDOW)
    comp_spec = CacheSpec(CacheKind.PAGED, dtype, 1, DIM, compress_rate=rate)
    args = dict(sinks=sinks, scale=DIM**-0.5, compressed=compressed, compressed_spec=comp_spec, indices=indices)
    return (q, kv, ring, ring_spec, meta), args


@pytest.mark.parametrize(("rate", "indexed"), [(4, True), (128, False)], ids=["csa", "hca"])
def test_both_launches_give_the_same_bits_and_the_reference(rate, indexed):
    inputs, args = _step(rate, indexed)
    split = sparse_attention.sparse_attention(*inputs, BLOCK, split=True, **args)
    single = sparse_attention.sparse_attention(*inputs, BLOCK, split=False, **args)
    assert torch.equal(split, single)
    want = ReferenceAttention(ReferenceKVLayout(torch.device("cuda"), BLOCK)).sparse_attention(*inputs, **args)
    torch.testing.assert_close(split.float(), want.float(), atol=2e-2, rtol=2e-2)
