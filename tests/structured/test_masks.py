"""A step's grammar masks (structured/masks.py): filled on a worker thread without drafts, on the caller's with
them; either way each row is its own grammar's mask, and only the constrained rows of the logits change."""

from __future__ import annotations

import torch

from deepinfer_core.engine.tokenizer import Tokenizer, demo_tokenizer_dir
from deepinfer_core.sampling.bitmask import allowed_tokens
from deepinfer_core.structured import GrammarCompiler, StructuredOutputsParams
from deepinfer_core.structured.masks import GrammarMasks
from deepinfer_core.structured.stats import StructuredOutputStats

VOCAB = 129280


def test_background_masks_are_each_rows_own_and_touch_only_constrained_rows():
    tokenizer = Tokenizer.from_dir(demo_tokenizer_dir())
    compiler = GrammarCompiler(tokenizer.to_json(), VOCAB, [tokenizer.eos_token_id])
    states = [compiler.state(StructuredOutputsParams(regex=r)) for r in ("[a-z]+", "[0-9]+", "(yes|no)")]
    for token in tokenizer.encode("ab", add_special_tokens=False):  # the first part-way through
        assert states[0].accept(token)
    alone = []
    for state in states:
        mask = torch.zeros(1, state.width, dtype=torch.int32)
        state.fill(mask, 0)
        alone.append(allowed_tokens(mask, VOCAB)[0])
    stats = StructuredOutputStats()
    rows = [0, 2, 3]  # of a 5-row step
    masks = GrammarMasks(rows, states, torch.device("cpu"), stats)
    assert masks.in_background
    logits = torch.randn(5, VOCAB)
    seen = masks.apply(None, logits)
    for row, allowed in zip(rows, alone):
        assert torch.equal(torch.isfinite(seen[row]), allowed), row
        assert torch.equal(seen[row][allowed], logits[row][allowed])
    for row in (1, 4):
        assert torch.equal(seen[row], logits[row])
    assert len(stats.mask_seconds) == len(rows) and all(s > 0 for s in stats.mask_seconds)
    with_drafts = GrammarMasks(rows, states, torch.device("cpu"), None, drafts=[[], [], []])
    assert not with_drafts.in_background
    assert torch.equal(with_drafts.apply(None, logits), seen)
