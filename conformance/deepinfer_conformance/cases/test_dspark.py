"""DeepSeek-V4.1's DSpark draft attention (block_attention) of the backend under test against the reference,
each over a window ring built in its own layout (the V4 attention cases' steps: shuffled sequence slots, poison
wherever a query must not read).

Every sequence's step rows are one draft block of 1..6 rows at positions first .. seq_len - 1; each row sees
the ring entries of positions max(first - window, window_start, 0) .. first - 1 and all the block's own
entries, both directions. The ring holds only those positions of each sequence; every other slot (positions
before the window, stale entries below window_start, spare sequence slots) is poison, and so are most of the
slots the block's own positions map to. Blocks start at position 0 (no context), inside the first window,
after the ring has wrapped many times, and just after a window_start; the ring is plain, or in V4.1's FP8
window format.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer_conformance.cases.test_v4_attention import DIM, DTYPES, HEADS, ROLLBACK, WINDOW, Step, backends, randn
from deepinfer_core.kv.formats import round_blocks
from deepinfer_core.kv.layout import CacheKind, CacheSpec

# Sequences of one step as (seq_len, block rows, window_start); the block's first position is seq_len - rows.
SCENARIOS = {
    # first < WINDOW: no context (first 0), some, exactly a window (first 8)
    "short": [(1, 1, 0), (6, 6, 0), (4, 2, 0), (10, 3, 0), (9, 1, 0)],
    # the ring has wrapped: positions one ring (13) apart share a slot
    "wrapped": [(300, 5, 0), (45, 1, 0), (131, 6, 0), (27, 4, 0), (64, 2, 0)],
    # window_start > first - WINDOW: the stale entries below it are excluded; at first, no context at all
    "stale": [(100, 4, 93), (20, 2, 18), (50, 6, 40), (31, 1, 27), (17, 3, 10)],
    # all of them, and a sequence with no rows in the step
    "ragged": [(300, 5, 0), (4, 2, 0), (50, 0, 0), (100, 4, 93), (1, 1, 0), (20, 2, 18), (9, 6, 0)],
}
RING_FORMATS = {"plain": "", "fp8": "fp8_e4m3/pow2:32"}  # fp8: V4.1's window KV (entries already rounded)


def block_attend(backend, seqs, q, window_entries, sinks, stored_format: str) -> torch.Tensor:
    """block_attention of `backend` over its own ring for this step; the result on CPU. Asserts the ring is
    left as it was (nothing is written)."""
    dtype, device = q.dtype, backend.torch_device
    step = Step(backend, seqs, seed=17)
    meta = dataclasses.replace(step.meta, max_query_len=max(q_len for _, q_len, _ in seqs))  # as the drafter
    spec = CacheSpec(
        CacheKind.SLIDING_WINDOW, dtype, 1, DIM, window=WINDOW, rollback_slots=ROLLBACK, stored_format=stored_format
    )
    ring = step.ring(spec, window_entries, reach=WINDOW)
    before = ring.clone()
    kv = torch.cat([entries[seq_len - q_len :] for entries, (seq_len, q_len, _) in zip(window_entries, seqs)])
    out = backend.attention.block_attention(
        q.to(device), kv.to(device), ring, spec, meta, sinks=sinks.to(device), scale=DIM**-0.5
    )
    assert torch.equal(ring, before), "block_attention wrote to the ring; it must leave it as it was"
    return out.cpu()


@pytest.mark.parametrize("block_size", ["default", "smallest"])
@pytest.mark.parametrize("ring_format", list(RING_FORMATS))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_block_attention(suite, check, dtype, scenario, ring_format, block_size):
    suite.require("block_attention")
    ours, ref = backends(suite, dtype, block_size, (CacheKind.SLIDING_WINDOW,))
    seqs, stored_format = SCENARIOS[scenario], RING_FORMATS[ring_format]
    window_entries = [randn(seq_len, DIM, seed=500 + b, dtype=dtype) for b, (seq_len, _, _) in enumerate(seqs)]
    if stored_format:
        window_entries = [round_blocks(entries, stored_format) for entries in window_entries]
    tokens = sum(q_len for _, q_len, _ in seqs)
    q = randn(tokens, HEADS, DIM, seed=18, dtype=dtype)
    sinks = randn(HEADS, seed=19)  # float32: a sink logit per head joins every softmax
    args = (seqs, q, window_entries, sinks, stored_format)
    actual, expected = block_attend(ours, *args), block_attend(ref, *args)
    assert actual.shape == (tokens, HEADS, DIM), f"output shape {tuple(actual.shape)}"
    assert actual.dtype == dtype, f"output dtype {actual.dtype}, expected q.dtype {dtype}"
    # each output averages up to WINDOW ring entries and the block's own rows
    longest = WINDOW + max(q_len for _, q_len, _ in seqs)
    magnitude = max(float(e.float().abs().max()) for e in window_entries)
    check.close(
        actual,
        expected,
        dtype,
        reduce_dim=longest,
        magnitude=magnitude,
        what=f"block attention (block size {ours.kv_layout.block_size} vs {ref.kv_layout.block_size})",
    )
