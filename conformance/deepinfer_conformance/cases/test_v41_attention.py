"""DeepSeek-V4.1's two-level indexer (indexer_select) of the backend under test against the reference, each
over a cache of indexer keys built in its own layout (the V4 attention cases' steps: shuffled blocks, poison
wherever a query must not read, prefills, chunked prefills, decodes and rows with no queries).

Three uses, as the model makes them: a plain index layer (top-k only), the candidate source (top-k and the
best blocks, the newest visible block pinned) and a re-scoring layer (top-k only among listed blocks). With
"zero_ties" scores most entries score exactly 0, so the contract's tie rule (lower entry, lower block)
decides; the choices are compared as a set per query, exactly.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_conformance.cases.test_v4_attention import (
    DTYPES,
    INDEX_DIM,
    SCENARIOS,
    TOP_K,
    Step,
    backends,
    indexer_inputs,
    query_positions,
)
from deepinfer_core.kv.layout import CacheKind, CacheSpec

INDEX_BLOCK = 4  # entries per block of the two-level top-k
TOP_BLOCKS = 3
# (top_blocks, restricted to listed blocks)
USES = {"index": (0, False), "candidate_source": (TOP_BLOCKS, False), "reindex": (0, True)}


def listed_blocks(seqs, rate: int, seed: int) -> torch.Tensor:
    """`within` [T, 4]: random block ids per query (visible, not yet visible, past every entry) and -1."""
    generator = torch.Generator().manual_seed(seed)
    blocks = -(-max(seq_len // rate for seq_len, _, _ in seqs) // INDEX_BLOCK) + 2
    tokens = sum(q_len for _, q_len, _ in seqs)
    return torch.randint(-1, blocks, (tokens, 4), generator=generator)


def select(backend, seqs, rate, inputs, within, top_blocks):
    """indexer_select of `backend` over its own PAGED cache of indexer keys; (indices, blocks) on CPU."""
    q, weights, keys = inputs
    step = Step(backend, seqs, seed=13)
    spec = CacheSpec(CacheKind.PAGED, q.dtype, 1, INDEX_DIM, compress_rate=rate)
    device = backend.torch_device
    indices, blocks = backend.attention.indexer_select(
        q.to(device),
        weights.to(device),
        step.compressed(spec, keys),
        spec,
        step.meta,
        top_k=TOP_K,
        scale=INDEX_DIM**-0.5,
        within=None if within is None else within.to(device),
        block_size=INDEX_BLOCK,
        top_blocks=top_blocks,
    )
    return indices.cpu(), None if blocks is None else blocks.cpu()


@pytest.mark.parametrize("block_size", ["default", "smallest"])
@pytest.mark.parametrize("use", list(USES))
@pytest.mark.parametrize("scores", ["distinct", "zero_ties"])
@pytest.mark.parametrize("rate", [1, 2])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_indexer_select(suite, check, dtype, scenario, rate, scores, use, block_size):
    suite.require("indexer_select")
    ours, ref = backends(suite, dtype, block_size, (CacheKind.PAGED,), rate)
    seqs = SCENARIOS[scenario]
    top_blocks, restricted = USES[use]
    inputs = indexer_inputs(seqs, rate, dtype, scores)
    within = listed_blocks(seqs, rate, seed=14) if restricted else None
    (indices, blocks), (want_indices, want_blocks) = (
        select(backend, seqs, rate, inputs, within, top_blocks) for backend in (ours, ref)
    )
    tokens = inputs[0].shape[0]
    assert indices.shape == (tokens, TOP_K) and indices.dtype == torch.int64, f"{tuple(indices.shape)}/{indices.dtype}"
    sizes = f"block size {ours.kv_layout.block_size} vs {ref.kv_layout.block_size}"
    if top_blocks:
        assert blocks is not None and blocks.shape == (tokens, top_blocks) and blocks.dtype == torch.int64, (
            f"blocks {None if blocks is None else (tuple(blocks.shape), blocks.dtype)}"
        )
        visible = (query_positions(seqs) + 1) // rate
        kept = (-(-visible // INDEX_BLOCK)).clamp(max=top_blocks)
        assert torch.equal((want_blocks >= 0).sum(dim=1), kept), "the reference keeps every block it can"
        check.equal(blocks.sort(dim=1).values, want_blocks.sort(dim=1).values, what=f"blocks kept per query ({sizes})")
    else:
        assert blocks is None, "top_blocks 0: blocks must be None"
    # the order of the picks is free: compare each query's sorted row (the -1 padding sorts first)
    check.equal(indices.sort(dim=1).values, want_indices.sort(dim=1).values, what=f"entries chosen ({sizes})")
