"""Structured outputs' token bitmask (deepinfer_core.sampling.bitmask) as the backend's sampler applies it (its
optional `apply_token_bitmask`, or core's definition where it has none) against the definition.

Every backend must: leave every allowed logit bit for bit as it was and set every disallowed one to -inf (rows
all allowed are unchanged; vocabularies not a multiple of 32; tokens past the mask's last word disallowed); keep a
row's result independent of the other rows; and, sampling the masked logits, never emit a disallowed token,
greedy or seeded.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_conformance.cases.test_sampler import sample, samplers, spread_seeds
from deepinfer_core.sampling.bitmask import apply_token_bitmask, bitmask_width, masked_logits, token_bitmask
from deepinfer_core.sampling.params import SamplingParams

VOCABS = [64, 1000, 129280]  # whole words, a ragged last word, DeepSeek's vocabulary


def logits_and_mask(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random logits and a mask: row 0 all allowed, row 1 one token, the rest random subsets (~1/4 of the
    vocabulary), the last row narrower than the vocabulary (its last words missing: those tokens disallowed)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    allowed: list = [None, [int(torch.randint(vocab, (1,), generator=g))]]
    for _ in range(rows - 2):
        allowed.append(torch.nonzero(torch.rand(vocab, generator=g) < 0.25).flatten().tolist())
    mask = token_bitmask(allowed, vocab)
    mask[-1, bitmask_width(vocab) // 2 :] = 0  # as if the mask ended there
    return logits, mask


def masked(backend, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    device = backend.torch_device
    return masked_logits(backend.sampler, logits.clone().to(device), mask.to(device)).cpu()


@pytest.mark.parametrize("vocab", VOCABS)
def test_masked_logits_are_the_definition_bit_for_bit(suite, check, vocab):
    ours, _ = samplers(suite)
    logits, mask = logits_and_mask(6, vocab, seed=vocab)
    expected = apply_token_bitmask(logits, mask)
    actual = masked(ours, logits, mask)
    check.equal(actual, expected, "masked logits")
    assert torch.equal(actual[0], logits[0]), "a row the mask allows entirely changed"


def test_a_rows_mask_does_not_depend_on_the_other_rows(suite, check):
    ours, _ = samplers(suite)
    logits, mask = logits_and_mask(9, 1000, seed=3)
    together = masked(ours, logits, mask)
    alone = torch.cat([masked(ours, logits[i : i + 1], mask[i : i + 1]) for i in range(9)])
    check.equal(together, alone, "rows masked together vs one at a time")


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_sampling_masked_logits_never_emits_a_disallowed_token(suite, temperature):
    ours, _ = samplers(suite)
    rows, vocab = 64, 1000
    logits, mask = logits_and_mask(rows, vocab, seed=11)
    logits[:, :8] += 20  # the unconstrained favourites, mostly disallowed
    params = [SamplingParams(temperature=temperature, seed=i) for i in range(rows)]
    out = sample(ours, masked(ours, logits, mask), params, spread_seeds(rows))
    allowed = apply_token_bitmask(torch.zeros(rows, vocab), mask).isfinite()
    picked = allowed[torch.arange(rows), out.token_ids]
    assert picked.all(), f"rows {torch.nonzero(~picked).flatten().tolist()} emitted tokens their masks disallow"
