"""Paged attention of the backend under test against the reference, each over a cache in its own layout.

Both backends get the same canonical cache entries at the same logical token positions, but each builds
its own cache: allocated and written through its own KVLayout, in blocks of its own block size, at block
ids the case picks (shuffled, non-contiguous, with unused blocks in between). The block tables and slot
mapping of the AttentionMetadata are therefore built per backend, in units of that backend's block size,
from the same logical positions; q, the scale and the value slice are identical. Every slot outside a
sequence's context (the tail of its last block, the unused blocks) holds large "poison" entries, so an
implementation that reads past seq_len or follows the wrong block changes the output visibly.
"""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer_core.backend.ops import AttentionMetadata
from deepinfer_core.kv.layout import CacheKind, CacheSpec, paged_slots

DTYPES = [torch.float32, torch.bfloat16]

# Sequences of one step as (seq_len, q_len): q_len == seq_len is a prefill, 1 < q_len < seq_len a chunked
# prefill, q_len == 1 a decode, q_len == 0 a row with nothing to compute this step. Lengths are chosen not to
# be multiples of the usual block sizes (16..128), except one that ends exactly on a block boundary.
SCENARIOS = {
    "prefill_b1": [(37, 37)],
    "ragged": [(45, 45), (300, 27), (133, 1), (77, 0), (256, 3), (1, 1)],
    "long_decode_and_prefill": [(1500, 1), (19, 19)],
}

# name: (query heads H, cached heads Hkv, entry dim Dc, key dim Dk, value_offset, value_dim)
MODELS = {
    # MLA in weight-absorbed form: one latent entry (kv_lora_rank 64 + rope 16) shared by 8 query heads;
    # keys are the whole entry, values its first 64 dims.
    "mla": (8, 1, 80, 80, 0, 64),
    # standard GQA: K | V side by side in one entry, two query heads per cached head.
    "gqa": (4, 2, 64, 32, 32, 32),
}

POISON_SCALE = 30.0  # entries outside every context: would dominate the softmax if attended to


def randn(*shape, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def build_step(backend, spec: CacheSpec, seqs, entries, seed: int):
    """A cache in `backend`'s own layout holding `entries` (one [seq_len, Hkv, Dc] per sequence) and the
    AttentionMetadata of the step, both on the backend's device, in units of its own block size."""
    layout, device = backend.kv_layout, backend.torch_device
    block_size = layout.block_size
    needed = [math.ceil(seq_len / block_size) for seq_len, _ in seqs]
    num_blocks = 2 * sum(needed) + 3  # room for unused blocks between the ones handed out
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    tables = torch.full((len(seqs), max(needed) + 1), -1, dtype=torch.int64)  # an always-unused column too
    handed = 0
    for b, count in enumerate(needed):
        tables[b, :count] = order[handed : handed + count]
        handed += count

    cache = layout.allocate(spec, num_blocks)
    all_slots = torch.arange(num_blocks * block_size)
    poison = randn(len(all_slots), *spec.entry_shape, seed=seed + 1, dtype=spec.dtype, scale=POISON_SCALE)
    layout.write(cache, spec, all_slots.to(device), poison.to(device))
    slot_mapping = []
    for b, ((seq_len, q_len), seq_entries) in enumerate(zip(seqs, entries)):
        positions = torch.arange(seq_len)
        layout.write(cache, spec, paged_slots(tables[b], positions, block_size).to(device), seq_entries.to(device))
        slot_mapping.append(paged_slots(tables[b], positions[seq_len - q_len :], block_size))

    q_lens = torch.tensor([q_len for _, q_len in seqs], dtype=torch.int64)
    meta = AttentionMetadata(
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(device),
        seq_lens=torch.tensor([seq_len for seq_len, _ in seqs], dtype=torch.int64).to(device),
        block_tables=tables.to(device),
        slot_mapping=torch.cat(slot_mapping).to(device),
    )
    return cache, meta


def attend(
    backend, spec: CacheSpec, seqs, entries, q: torch.Tensor, *, value_offset: int, value_dim: int, seed: int
) -> torch.Tensor:
    """paged_attention of `backend` over its own cache for this step; the result on CPU."""
    cache, meta = build_step(backend, spec, seqs, entries, seed)
    out = backend.attention.paged_attention(
        q.to(backend.torch_device),
        cache,
        spec,
        meta,
        scale=q.shape[-1] ** -0.5,
        value_dim=value_dim,
        value_offset=value_offset,
    )
    return out.cpu()


@pytest.mark.parametrize("block_size", ["default", "smallest"])
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_attention(suite, check, dtype, scenario, model, block_size):
    suite.require("paged_attention")
    suite.require_declared("cache_kinds", CacheKind.PAGED)
    if block_size == "default":
        ours, ref = suite.pair(dtype)
    else:  # the backend's smallest block (many blocks per sequence) against the reference's default size
        suite.require_dtype(dtype)
        ours = suite.resolved(suite.under_test, dtype, min(suite.capabilities.block_sizes))
        ref = suite.resolved(suite.reference, dtype)

    heads, kv_heads, entry_dim, key_dim, value_offset, value_dim = MODELS[model]
    seqs = SCENARIOS[scenario]
    spec = CacheSpec(CacheKind.PAGED, dtype, num_heads=kv_heads, head_dim=entry_dim)
    entries = [randn(seq_len, kv_heads, entry_dim, seed=100 + b, dtype=dtype) for b, (seq_len, _) in enumerate(seqs)]
    tokens = sum(q_len for _, q_len in seqs)
    q = randn(tokens, heads, key_dim, seed=7, dtype=dtype)

    kwargs = dict(value_offset=value_offset, value_dim=value_dim, seed=11)
    actual = attend(ours, spec, seqs, entries, q, **kwargs)
    expected = attend(ref, spec, seqs, entries, q, **kwargs)
    assert actual.shape == (tokens, heads, value_dim), f"output shape {tuple(actual.shape)}"
    assert actual.dtype == dtype, f"output dtype {actual.dtype}, expected q.dtype {dtype}"
    # Each output is a softmax-weighted sum over up to seq_len cached values (the key dot products are
    # shorter, <= 80): scale the tolerance by the longest context of the step.
    longest = max(seq_len for seq_len, q_len in seqs if q_len)
    check.close(
        actual,
        expected,
        dtype,
        reduce_dim=longest,
        magnitude=max(float(e.float().abs().max()) for e in entries),  # outputs average cached values
        what=f"paged attention (block size {ours.kv_layout.block_size} vs {ref.kv_layout.block_size})",
    )
