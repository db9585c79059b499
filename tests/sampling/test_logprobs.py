"""Core's logprob views: ranks as vLLM counts them, logprobs of given tokens, and raw logprobs of masked rows."""

from __future__ import annotations

import math

import torch

from deepinfer_core.sampling.logprobs import logprobs_of, ranks_of, with_raw_logprobs
from deepinfer_core.sampling.sampler import SampleOutput


def test_ranks_count_the_tokens_at_least_as_likely():
    scores = torch.tensor([[0.5, 2.0, 1.0, 2.0], [3.0, -1.0, 0.0, 1.0]])
    ranks = ranks_of(scores, torch.tensor([2, 0])).tolist()
    assert ranks == [3, 1]
    assert ranks_of(scores, torch.tensor([1, 1])).tolist() == [2, 4]  # a tie counts both (vLLM's >=)


def test_logprobs_of_tokens_with_rank_and_top_alternatives():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    got = logprobs_of(logits, torch.tensor([2]), k=2)
    total = math.log(sum(math.exp(x) for x in (1.0, 3.0, 2.0, 0.0)))
    assert math.isclose(got.logprobs.item(), 2.0 - total, abs_tol=1e-6)
    assert got.ranks.tolist() == [2]
    assert got.top_ids.tolist() == [[1, 2]]
    assert torch.allclose(got.top_logprobs, torch.tensor([[3.0 - total, 2.0 - total]]))


def test_masked_rows_get_the_raw_logprobs_back():
    raw = torch.tensor([[0.0, 4.0, 1.0], [2.0, 0.0, 1.0]])
    masked = raw.clone()
    masked[0, 1] = float("-inf")
    sampled = masked.log_softmax(dim=1)
    output = SampleOutput(
        token_ids=torch.tensor([2, 0]),
        logprobs=sampled[[0, 1], [2, 0]],
        top_token_ids=sampled.topk(1).indices,
        top_logprobs=sampled.topk(1).values,
    )
    fixed = with_raw_logprobs(output, raw, torch.tensor([0]))
    raw_logprobs = raw.log_softmax(dim=1)
    assert torch.allclose(fixed.logprobs, torch.stack([raw_logprobs[0, 2], raw_logprobs[1, 0]]))
    assert fixed.top_token_ids.tolist() == [[1], [0]]  # row 0's masked token is its likeliest raw one
    assert torch.equal(fixed.token_ids, output.token_ids)
