"""Structured outputs' token bitmask (sampling/bitmask.py) against hand-worked words: bit t % 32 of word t // 32,
the sign bit (token 31 of a word) included, tokens past the last word disallowed, allowed logits untouched."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.sampling.bitmask import allowed_tokens, apply_token_bitmask, masked_logits, token_bitmask
from deepinfer_core.sampling.sampler import TorchSampler


def test_words_are_built_and_read_bit_by_bit():
    mask = token_bitmask([[0, 31, 32, 40], None, []], vocab_size=45)
    # 0x80000001 (tokens 0 and 31: the sign bit), 0x101 (32 and 40); every token of 45: -1, then bits 0..12
    assert mask.tolist() == [[-(2**31) + 1, 257], [-1, 8191], [0, 0]]
    assert allowed_tokens(mask, 45)[0].nonzero().flatten().tolist() == [0, 31, 32, 40]
    assert allowed_tokens(mask, 45)[1].all() and not allowed_tokens(mask, 45)[2].any()


def test_disallowed_tokens_get_minus_infinity_and_the_rest_keep_their_bits():
    logits = torch.randn(3, 70, generator=torch.Generator().manual_seed(0))
    mask = token_bitmask([[5, 63], None, list(range(64, 70))], vocab_size=70)
    out = apply_token_bitmask(logits, mask)
    assert out[0].isfinite().nonzero().flatten().tolist() == [5, 63]
    assert torch.equal(out[0, [5, 63]], logits[0, [5, 63]]) and torch.equal(out[1], logits[1])
    narrow = apply_token_bitmask(logits, mask[:, :2])  # tokens 64.. lie past the mask's two words
    assert narrow[2].isinf().all() and torch.equal(narrow[1, :64], logits[1, :64])


def test_a_malformed_mask_is_refused():
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask(torch.zeros(2, 40), torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="one row per logits row"):
        apply_token_bitmask(torch.zeros(2, 40), torch.zeros(3, 2, dtype=torch.int32))


def test_a_samplers_own_mask_is_used_where_it_has_one():
    calls = []

    def kernel(logits, mask):
        calls.append(mask.shape)
        return apply_token_bitmask(logits, mask)

    logits, mask = torch.zeros(1, 40), token_bitmask([[3]], 40)
    assert masked_logits(TorchSampler(bitmask=kernel), logits, mask).isfinite().sum() == 1 and calls
    assert masked_logits(object(), logits, mask).isfinite().nonzero().flatten().tolist() == [0, 3]
