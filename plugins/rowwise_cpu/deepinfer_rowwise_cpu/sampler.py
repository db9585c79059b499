"""rowwise_cpu's sampler kernels (deepinfer_core.sampling.sampler.Sampler), one request row at a time; imports
only torch and core's sampling data types and noise definition.

Semantics are core's (see deepinfer_core.sampling.sampler): logprobs from the raw logits; repetition, then
frequency and presence penalties; temperature 0 is greedy; otherwise logits / temperature, top-k, top-p
on the renormalised top-k distribution, min-p; token = argmax(filtered + gumbel_noise(seed, step, token)).
The noise is core's `gumbel_noise` (its definition must be bit-identical); the filtering is ours.
"""

from __future__ import annotations

import torch

from deepinfer_core.sampling.noise import gumbel_noise
from deepinfer_core.sampling.sampler import SampleOutput, SamplingBatch
from deepinfer_rowwise_cpu.kernels import fresh_row

__all__ = ["RowwiseSampler"]


def _log_softmax(row: torch.Tensor) -> torch.Tensor:
    """row [V] float32 -> log probabilities [V]."""
    shifted = row - row.max()
    return shifted - torch.log(torch.exp(shifted).sum())


def _penalized(row: torch.Tensor, batch: SamplingBatch, b: int) -> torch.Tensor:
    """Repetition (prompt + output tokens), then frequency and presence (output tokens) penalties on row [V]."""
    vocab = row.shape[0]
    prompt, output = batch.prompt_tokens[b], batch.output_tokens[b]  # [Lp], [Lo], -1 padded
    counts = torch.bincount(output[output >= 0], minlength=vocab)[:vocab].float()  # [V]
    seen = counts > 0
    seen[prompt[prompt >= 0]] = True
    rep = batch.repetition_penalty[b : b + 1]  # [1]
    row = torch.where(seen, torch.where(row > 0, row / rep, row * rep), row)
    row = row - batch.frequency_penalty[b : b + 1] * counts
    return row - batch.presence_penalty[b : b + 1] * (counts > 0).float()


def _filtered(scaled: torch.Tensor, batch: SamplingBatch, b: int) -> torch.Tensor:
    """Temperature-scaled row [V] with every token outside top-k, then top-p, then min-p set to -inf."""
    vocab = scaled.shape[0]
    k = int(batch.top_k[b])
    k = k if 0 < k < vocab else vocab
    best, ids = scaled.topk(k)  # [k], best first
    e = torch.exp(best - best[0])
    probs = e / e.sum()  # the top-k renormalised distribution, [k]
    mass_before = probs.cumsum(dim=0) - probs  # probability of better-ranked tokens
    keep = mass_before < batch.top_p[b : b + 1]  # the first token always stays
    keep &= probs >= batch.min_p[b : b + 1] * probs[0]
    out = torch.full_like(scaled, float("-inf"))
    out[ids[keep]] = best[keep]
    return out


class RowwiseSampler:
    """Implements Sampler; each row sees only its own logits, parameters, seed and step."""

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        rows, vocab = logits.shape  # [B, V]
        n = batch.num_logprobs
        token_ids = torch.empty(rows, dtype=torch.int64, device=logits.device)  # [B]
        chosen = torch.empty(rows, dtype=torch.float32, device=logits.device)  # [B]
        top_ids = torch.empty(rows, n, dtype=torch.int64, device=logits.device)  # [B, n]
        top_lp = torch.empty(rows, n, dtype=torch.float32, device=logits.device)  # [B, n]
        for b in range(rows):
            row = fresh_row(logits[b])  # [V] float32
            logprobs = _log_softmax(row)
            penalized = _penalized(row, batch, b)
            temperature = batch.temperature[b : b + 1]  # [1]
            if bool(temperature > 0):
                noise = gumbel_noise(batch.seeds[b : b + 1], batch.steps[b : b + 1], vocab)[0]  # [V]
                token = torch.argmax(_filtered(penalized / temperature, batch, b) + noise)
            else:
                token = torch.argmax(penalized)
            token_ids[b] = token
            chosen[b] = logprobs[token]
            top_lp[b], top_ids[b] = logprobs.topk(n)
        return SampleOutput(token_ids=token_ids, logprobs=chosen, top_token_ids=top_ids, top_logprobs=top_lp)

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """Structured outputs' mask (core's semantics), one row at a time: a token whose bit is clear in its row's
        int32 words, or past them, gets -inf; the other logits keep their bits. Returns a new tensor."""
        rows, vocab = logits.shape
        if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[0] != rows:
            raise ValueError(f"a token bitmask is int32 [{rows}, words]; got {bitmask.dtype} {tuple(bitmask.shape)}")
        out = logits.clone()
        tokens = torch.arange(vocab)
        for b in range(rows):
            words = bitmask[b]  # [W]
            inside = tokens < 32 * words.shape[0]
            word = words[(tokens // 32).clamp(max=words.shape[0] - 1)]
            allowed = inside & (((word >> (tokens % 32).to(torch.int32)) & 1) == 1)
            out[b, ~allowed] = float("-inf")
        return out
