"""Rejection sampling of drafted tokens (speculative decoding's "acceptance": "rejection").

For a draft model that proposes one token d with certainty (greedy drafts: ngram, MTP), standard speculative
sampling keeps d with probability p(d), p being the distribution the sampler draws from (after penalties,
temperature, top-k / top-p / min-p), and otherwise draws from p with d taken out, renormalised; so the token is
distributed exactly as p. The coin is a counter-based uniform of (seed, step) from the noise's own hash, at a
counter no token id uses; the redraw is the sampler's Gumbel-max over the filtered logits with d at -inf, with
the noise of the same (seed, step). Greedy rows (temperature 0) are left as sampled: p is a point mass there.
"""

from __future__ import annotations

import dataclasses

import torch

from deepinfer_core.sampling.noise import gumbel_noise, hash_counters
from deepinfer_core.sampling.sampler import SamplingBatch, apply_penalties, filter_logits

__all__ = ["rejection_tokens", "select_rows"]


def select_rows(batch: SamplingBatch, rows: torch.Tensor) -> SamplingBatch:
    """The batch's rows `rows` [R] (a device index)."""
    picked = {
        f.name: getattr(batch, f.name)[rows]
        for f in dataclasses.fields(batch)
        if isinstance(getattr(batch, f.name), torch.Tensor)
    }
    return dataclasses.replace(batch, **picked)


def rejection_tokens(logits: torch.Tensor, batch: SamplingBatch, drafts: torch.Tensor) -> torch.Tensor:
    """logits [R, V] (what the sampler saw), the rows' sampling inputs, drafts [R] -> tokens [R]: the draft
    where its coin falls under p(draft), else a draw from p without it."""
    vocab = logits.shape[1]
    penalized = apply_penalties(logits, batch) if batch.any_penalty else logits
    filtered = filter_logits(penalized, batch)  # [R, V], -inf outside the filters
    p_draft = torch.softmax(filtered, dim=1).gather(1, drafts[:, None])[:, 0]
    coin = (hash_counters(batch.seeds, batch.steps, vocab + 1)[:, vocab].to(torch.float64) + 0.5) / 2.0**32
    without = filtered.scatter(1, drafts[:, None], float("-inf"))
    redraw = (without + gumbel_noise(batch.seeds, batch.steps, vocab)).argmax(dim=1)
    random_rows = batch.temperature > 0
    keep = coin < p_draft.to(torch.float64)
    tokens = torch.where(keep, drafts, redraw)
    greedy = penalized.argmax(dim=1)
    return torch.where(random_rows, tokens, greedy)
