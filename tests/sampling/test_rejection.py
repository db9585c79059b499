"""Rejection sampling of a drafted token (sampling/rejection.py): over many seeds the token is distributed as
the sampler's p (chi-square against exact expected counts, and a wrong variant that fails the same check);
the draft is kept about p(draft) of the time; filters and greedy rows behave as the sampler does."""

from __future__ import annotations

import torch

from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.sampling.rejection import rejection_tokens
from deepinfer_core.sampling.sampler import SamplingBatch, filter_logits

N, V = 40_000, 8
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 3.0])
CRITICAL = 40.0  # chi-square, 7 degrees of freedom: P(X > 40) is about 1e-6


def batch(params: SamplingParams) -> SamplingBatch:
    seeds = list(range(N))
    return SamplingBatch.build([params] * N, seeds, [[]] * N, [[1, 2, 3]] * N)  # output step 3 for every row


def chi_square(tokens: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=V).double()
    expected = p.double() * N
    live = expected > 0
    assert (counts[~live] == 0).all(), "a token outside the filters was drawn"
    return float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())


def test_the_token_is_distributed_as_p_and_the_draft_is_kept_p_of_the_time():
    params = SamplingParams(temperature=0.8)
    b = batch(params)
    p = torch.softmax(LOGITS / 0.8, dim=0)
    for draft in (7, 2, 6):  # the likeliest token, a middling one, an unlikely one
        drafts = torch.full((N,), draft)
        tokens = rejection_tokens(LOGITS.expand(N, V), b, drafts)
        assert chi_square(tokens, p) < CRITICAL
        kept = float((tokens == draft).double().mean())
        assert abs(kept - float(p[draft])) < 4 * (float(p[draft]) * (1 - float(p[draft])) / N) ** 0.5


def test_the_check_fails_for_a_redraw_that_does_not_take_the_draft_out():
    """Negative control: redrawing from p itself after a rejection over-weights the draft."""
    from deepinfer_core.sampling.noise import gumbel_noise, hash_counters

    b, draft = batch(SamplingParams(temperature=0.8)), 7
    p = torch.softmax(LOGITS / 0.8, dim=0)
    coin = (hash_counters(b.seeds, b.steps, V + 1)[:, V].double() + 0.5) / 2.0**32
    plain = (LOGITS / 0.8 + gumbel_noise(b.seeds, b.steps, V)).argmax(dim=1)
    wrong = torch.where(coin < p[draft].double(), torch.full((N,), draft), plain)
    assert chi_square(wrong, p) > CRITICAL


def test_filters_apply_and_greedy_rows_take_the_argmax():
    params = SamplingParams(temperature=1.0, top_k=3)
    b = batch(params)
    p = torch.softmax(filter_logits(LOGITS.expand(1, V), SamplingBatch.build([params], [0], [[]], [[]]))[0], dim=0)
    tokens = rejection_tokens(LOGITS.expand(N, V), b, torch.full((N,), 6))  # a draft outside the top 3
    assert (tokens != 6).all() and chi_square(tokens, p) < CRITICAL
    greedy = SamplingBatch.build([SamplingParams(temperature=0)] * 3, [0, 1, 2], [[]] * 3, [[]] * 3)
    assert rejection_tokens(LOGITS.expand(3, V), greedy, torch.tensor([7, 0, 3])).tolist() == [7, 7, 7]
