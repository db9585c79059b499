"""Sampler semantics: penalties, temperature, top-k / top-p / min-p, counter-based Gumbel-max, logprobs.

`TorchSampler` is the definition (plain tensor ops, any device) and the core default for backends
that do not ship their own sampler kernels. Order of operations, per request:
  1. logprobs are taken from the logits the sampler receives (the model's, after any plugin logits
     processors; before penalties and temperature), as vLLM's raw logprobs;
  2. penalties: repetition (prompt and output tokens: positive logits divided, negative multiplied),
     then frequency (x count in output) and presence (once if in output) subtracted;
  3. temperature 0 -> argmax of the penalized logits; otherwise logits / temperature, then
     top-k, then top-p on the top-k-renormalized distribution p (a token stays while the mass of
     strictly better-ranked tokens is < top_p, so the best always stays), then min-p on that same p
     (p >= min_p * max p); ties in the ranking follow torch.sort's order (descending, by value);
  4. token = argmax(filtered logits + gumbel_noise(seed, step, token id)).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from deepinfer_core.engine.transfer import to_device
from deepinfer_core.sampling.bitmask import apply_token_bitmask
from deepinfer_core.sampling.noise import gumbel_noise
from deepinfer_core.sampling.params import SamplingParams

__all__ = ["SampleOutput", "Sampler", "SamplingBatch", "TorchSampler"]


def _as_int64_seed(seed: int) -> int:
    """A seed in [0, 2**64) as the int64 with the same bits."""
    return seed - 2**64 if seed >= 2**63 else seed


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """Per-row sampling inputs for one step, as tensors on the device. Rows are requests."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    repetition_penalty: torch.Tensor  # [B] float32
    presence_penalty: torch.Tensor  # [B] float32
    frequency_penalty: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64 (bits of the uint64 seed)
    steps: torch.Tensor  # [B] int64, index of the token being generated
    prompt_tokens: torch.Tensor  # [B, Lp] int64, -1 padded; [B, 0] when no row has a penalty (unused then)
    output_tokens: torch.Tensor  # [B, Lo] int64, -1 padded; [B, 0] when no row has a penalty
    num_logprobs: int  # top logprobs to return per row (max over the batch)
    # host-side summaries of the columns above, so a sampler can skip work without reading the device;
    # True (the default) is always correct, it only means "do the work"
    any_random: bool = True  # some row has temperature > 0
    any_filter: bool = True  # some row has top-k, top-p < 1 or min-p > 0
    any_penalty: bool = True  # some row has a repetition, presence or frequency penalty

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        prompt_tokens: Sequence[Sequence[int]],
        output_tokens: Sequence[Sequence[int]],
        device: torch.device | str = "cpu",
    ) -> SamplingBatch:
        """Stack per-request parameters; `seeds` are the requests' seeds (drawn by core when unset)."""
        device = torch.device(device)

        def column(values, dtype):  # on the host: the flags below are read from it, not from the device
            return torch.tensor(values, dtype=dtype)

        def padded(rows):
            width = max((len(r) for r in rows), default=0)
            out = torch.full((len(rows), width), -1, dtype=torch.int64)
            for i, row in enumerate(rows):
                out[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
            return out

        temperature = column([p.temperature for p in params], torch.float32)
        top_k = column([max(p.top_k, 0) for p in params], torch.int64)
        top_p = column([p.top_p for p in params], torch.float32)
        min_p = column([p.min_p for p in params], torch.float32)
        repetition = column([p.repetition_penalty for p in params], torch.float32)
        presence = column([p.presence_penalty for p in params], torch.float32)
        frequency = column([p.frequency_penalty for p in params], torch.float32)
        steps = column([len(o) for o in output_tokens], torch.int64)  # index of the token being generated
        any_penalty = bool((repetition != 1).any() or (presence != 0).any() or (frequency != 0).any())
        if not any_penalty:  # the token lists only feed the penalties: skip building and copying them
            prompt_tokens = output_tokens = [[] for _ in params]
        host = cls(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition,
            presence_penalty=presence,
            frequency_penalty=frequency,
            seeds=column([_as_int64_seed(s) for s in seeds], torch.int64),
            steps=steps,
            prompt_tokens=padded(prompt_tokens),
            output_tokens=padded(output_tokens),
            num_logprobs=max((p.logprobs or 0 for p in params), default=0),
            any_random=bool((temperature > 0).any()),
            any_filter=bool((top_k > 0).any() or (top_p < 1).any() or (min_p > 0).any()),
            any_penalty=any_penalty,
        )
        return host.to(device)

    def to(self, device: torch.device) -> SamplingBatch:
        """This batch with its tensors on `device` (copies that do not wait for the device's queued work)."""
        moved = {
            f: to_device(getattr(self, f), device)
            for f in self.__dataclass_fields__
            if isinstance(getattr(self, f), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)


@dataclass(frozen=True, slots=True)
class SampleOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32, raw logprob of the chosen token
    top_token_ids: torch.Tensor  # [B, num_logprobs] int64
    top_logprobs: torch.Tensor  # [B, num_logprobs] float32


@runtime_checkable
class Sampler(Protocol):
    """Chooses tokens. Optional: `apply_token_bitmask(logits, bitmask) -> logits`, structured outputs' mask with
    sampling/bitmask.py's semantics (it may write into `logits`); without it core applies the definition."""

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        """Choose one token per row of logits [B, V] (float32) by the semantics of this module."""
        ...


def _token_counts(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """tokens [B, L] (-1 padded) -> counts [B, V] float32."""
    counts = torch.zeros(tokens.shape[0], vocab_size + 1, dtype=torch.float32, device=tokens.device)
    index = torch.where(tokens < 0, vocab_size, tokens)  # padding lands in a spare column
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    vocab = logits.shape[1]
    output_counts = _token_counts(batch.output_tokens, vocab)  # [B, V]
    seen = (output_counts + _token_counts(batch.prompt_tokens, vocab)) > 0
    rep = batch.repetition_penalty[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - batch.frequency_penalty[:, None] * output_counts
    return logits - batch.presence_penalty[:, None] * (output_counts > 0).float()


def filter_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature-scaled logits with everything outside top-k / top-p / min-p set to -inf."""
    temperature = torch.where(batch.temperature > 0, batch.temperature, torch.ones_like(batch.temperature))
    scaled = logits / temperature[:, None]
    if not batch.any_filter:
        return scaled  # no filter asked for: skip the sort over the vocabulary
    vocab = scaled.shape[1]
    sorted_logits, order = scaled.sort(dim=1, descending=True)  # [B, V]
    ranks = torch.arange(vocab, device=scaled.device)[None, :]
    top_k = torch.where(batch.top_k > 0, batch.top_k, vocab)
    keep = ranks < top_k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=1)
    mass_before = probs.cumsum(dim=1) - probs  # probability of better-ranked tokens
    keep &= mass_before < batch.top_p[:, None]  # the first token always stays
    keep &= probs >= batch.min_p[:, None] * probs[:, :1]
    kept_sorted = sorted_logits.masked_fill(~keep, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, kept_sorted)


class TorchSampler:
    """The reference sampler: plain tensor ops, runs on any torch device.

    noise: the Gumbel noise function (seeds [B], steps [B], vocab size) -> [B, V] float32; a backend may
    pass a kernel of its own, which must return the bits of `gumbel_noise` (the conformance suite checks
    that seeded tokens match the reference's). bitmask: likewise a kernel for `apply_token_bitmask`.
    """

    def __init__(
        self,
        noise: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] = gumbel_noise,
        bitmask: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = apply_token_bitmask,
    ) -> None:
        self.noise, self._bitmask = noise, bitmask

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """Structured outputs' mask (sampling/bitmask.py): `bitmask`, a backend's kernel of the same semantics."""
        return self._bitmask(logits, bitmask)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=1)  # [B, V]
        # with no penalty in the batch they are the identity (x / 1, x * 1, x - 0): skip them
        penalized = apply_penalties(logits, batch) if batch.any_penalty else logits
        token_ids = penalized.argmax(dim=1)
        if batch.any_random:  # an all-greedy batch needs no filtering and no noise
            noisy = filter_logits(penalized, batch) + self.noise(batch.seeds, batch.steps, logits.shape[1])
            token_ids = torch.where(batch.temperature > 0, noisy.argmax(dim=1), token_ids)
        top_logprobs, top_ids = raw_logprobs.topk(batch.num_logprobs, dim=1)
        return SampleOutput(
            token_ids=token_ids,
            logprobs=raw_logprobs.gather(1, token_ids[:, None]).squeeze(1),
            top_token_ids=top_ids,
            top_logprobs=top_logprobs,
        )
