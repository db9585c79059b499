"""On a GPU only (skipped elsewhere): DSpark's block attention (kernels.block_attention) at DeepSeek-V4.1 Flash's
window shapes against the reference, over a bfloat16 ring and one packed in FP8 (NvidiaKVLayout); captured in a
CUDA graph and replayed over other blocks (it reads nothing on the host); and in batch-invariant mode each
sequence's rows are the same bits alone as in the step."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from deepinfer_core.backend.ops import AttentionMetadata  # noqa: E402
from deepinfer_core.kv.formats import round_blocks  # noqa: E402
from deepinfer_core.kv.layout import CacheKind, CacheSpec  # noqa: E402
from deepinfer_core.reference.attention import ReferenceAttention  # noqa: E402
from deepinfer_nvidia_sm100.kv import NvidiaKVLayout  # noqa: E402
from deepinfer_nvidia_sm100.ops import NvidiaAttention  # noqa: E402

CUDA = torch.device("cuda")
HEADS, DIM, WINDOW, ROLLBACK, K = 64, 512, 128, 6, 5  # k = 5 rows a block
# each block's first position and window start: a long context, a window start that cuts the window, one past
# the window, a short context, none
FIRSTS, STARTS = [3000, 700, 129, 5, 0], [0, 650, 0, 0, 0]
FORMATS = {"bf16": "", "fp8": "fp8_e4m3/pow2:32"}


def _step(stored_format: str, seed: int = 0, firsts=FIRSTS, starts=STARTS):
    """(layout, spec, ring, meta, q, kv, sinks): every ring slot holds an entry (those a block must not read too)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    layout = NvidiaKVLayout(CUDA, 128)
    spec = CacheSpec(CacheKind.SLIDING_WINDOW, torch.bfloat16, 1, DIM, window=WINDOW, rollback_slots=ROLLBACK,
                     stored_format=stored_format)  # fmt: skip
    seqs = len(firsts)
    ring = layout.allocate(spec, seqs + 1)
    rows = ring.shape[0]
    entries = torch.randn(rows, 1, DIM, generator=g, device="cuda").to(torch.bfloat16)
    entries = round_blocks(entries, stored_format) if stored_format else entries
    layout.write(ring, spec, torch.arange(rows, device="cuda"), entries)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(seqs + 1, device="cuda") * K,
        seq_lens=torch.tensor(firsts, device="cuda") + K,
        block_tables=torch.zeros(seqs, 1, dtype=torch.int64, device="cuda"),
        slot_mapping=torch.zeros(seqs * K, dtype=torch.int64, device="cuda"),
        seq_slots=torch.randperm(seqs + 1, generator=g, device="cuda")[:seqs],
        window_starts=torch.tensor(starts, device="cuda"),
        max_query_len=K,
    )
    q = torch.randn(seqs * K, HEADS, DIM, generator=g, device="cuda").to(torch.bfloat16)
    kv = torch.randn(seqs * K, DIM, generator=g, device="cuda").to(torch.bfloat16)
    return layout, spec, ring, meta, q, kv, torch.randn(HEADS, generator=g, device="cuda")


def _assert_matches(out: torch.Tensor, expected: torch.Tensor) -> None:
    """The conformance suite's bfloat16 tolerance for an average of WINDOW + K entries of |x| < 6."""
    atol = 1e-5 * math.sqrt(WINDOW + K) + torch.finfo(torch.bfloat16).eps * 6
    torch.testing.assert_close(out, expected, rtol=1.6e-2, atol=atol)


@pytest.mark.parametrize("ring", list(FORMATS))
def test_block_attention_matches_reference(ring):
    layout, spec, cache, meta, q, kv, sinks = _step(FORMATS[ring])
    out = NvidiaAttention(layout).block_attention(q, kv, cache, spec, meta, sinks=sinks, scale=DIM**-0.5)
    want = ReferenceAttention(layout).block_attention(q, kv, cache, spec, meta, sinks=sinks, scale=DIM**-0.5)
    _assert_matches(out, want)


def test_a_captured_graph_replays_over_other_blocks():
    layout, spec, cache, meta, q, kv, sinks = _step(FORMATS["fp8"])
    attention = NvidiaAttention(layout)

    def attend():
        return attention.block_attention(q, kv, cache, spec, meta, sinks=sinks, scale=DIM**-0.5)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attend()  # warm-up
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend()
    # other blocks in the same static tensors: other positions, window starts, slots, queries and entries
    _, _, _, other, q2, kv2, _ = _step(FORMATS["fp8"], 1, firsts=[40, 2000, 3, 131, 900], starts=[0, 0, 0, 10, 880])
    for mine, theirs in ((meta.seq_lens, other.seq_lens), (meta.window_starts, other.window_starts),
                         (meta.seq_slots, other.seq_slots), (q, q2), (kv, kv2)):  # fmt: skip
        mine.copy_(theirs)
    graph.replay()
    want = ReferenceAttention(layout).block_attention(q, kv, cache, spec, meta, sinks=sinks, scale=DIM**-0.5)
    _assert_matches(out, want)


def test_batch_invariant_rows_are_the_same_alone():
    layout, spec, cache, meta, q, kv, sinks = _step(FORMATS["fp8"])
    attention = NvidiaAttention(layout, batch_invariant=True)
    full = attention.block_attention(q, kv, cache, spec, meta, sinks=sinks, scale=DIM**-0.5)
    want = ReferenceAttention(layout).block_attention(q, kv, cache, spec, meta, sinks=sinks, scale=DIM**-0.5)
    _assert_matches(full, want)
    for b in range(meta.num_seqs):
        rows = slice(b * K, (b + 1) * K)
        alone = dataclasses.replace(
            meta, query_start_loc=torch.tensor([0, K], device="cuda"), seq_lens=meta.seq_lens[b : b + 1],
            block_tables=meta.block_tables[b : b + 1], slot_mapping=meta.slot_mapping[rows],
            seq_slots=meta.seq_slots[b : b + 1], window_starts=meta.window_starts[b : b + 1],
        )  # fmt: skip
        out = attention.block_attention(q[rows], kv[rows], cache, spec, alone, sinks=sinks, scale=DIM**-0.5)
        assert torch.equal(out, full[rows]), b
