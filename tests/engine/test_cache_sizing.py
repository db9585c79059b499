"""The engine sizes the KV cache from a memory budget: per-sequence caches (DeepSeek-V4's windows and
compressor state) are set aside for every sequence slot first, and a budget too small for them is a clear
error, not a one-block cache."""

from __future__ import annotations

import pytest

from deepinfer_core.engine.llm import LLM
from deepinfer_core.errors import DeepInferError
from deepinfer_core.kv.caches import block_bytes, sequence_bytes


def test_blocks_fill_what_the_sequence_slots_leave():
    budget = 64 << 20
    llm = LLM(kv_cache_memory_bytes=budget, max_num_seqs=4, progress=False)  # the V4 demo model
    specs, size = llm.model.cache_specs, llm.engine.blocks.block_size
    per_sequence, per_block = sequence_bytes(specs), block_bytes(specs, size)
    assert per_sequence > 0 and per_block > 0
    assert llm.engine.blocks.num_blocks == (budget - 4 * per_sequence) // per_block


def test_a_budget_below_the_sequence_caches_is_refused():
    with pytest.raises(DeepInferError, match="does not fit the per-sequence caches of 64 sequences"):
        LLM(kv_cache_memory_bytes=1 << 20, progress=False)
