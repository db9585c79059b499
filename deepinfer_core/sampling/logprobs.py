"""Logprob views the engine reports beyond what a backend's sampler returns: ranks of chosen tokens,
prompt logprobs, and the raw logprobs of rows whose logits core masked (min_tokens). Plain tensor ops on
any device; nothing here reads values back to the host."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer_core.sampling.sampler import SampleOutput

__all__ = ["TokenLogprobs", "logprobs_of", "ranks_of", "reports_logprobs", "with_raw_logprobs"]


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Raw logprobs of given tokens, with their ranks and the top alternatives (on the device)."""

    logprobs: torch.Tensor  # [P] float32
    ranks: torch.Tensor  # [P] int64, 1 = most likely
    top_ids: torch.Tensor  # [P, k] int64
    top_logprobs: torch.Tensor  # [P, k] float32

    @classmethod
    def cat(cls, parts: Sequence[TokenLogprobs]) -> TokenLogprobs:
        return cls(
            *(torch.cat([getattr(p, f) for p in parts]) for f in ("logprobs", "ranks", "top_ids", "top_logprobs"))
        )


def ranks_of(scores: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Rank [B] of token_ids [B] under scores [B, V] (logits or logprobs: the order is the same): how many
    tokens score at least as high as it, itself included, as vLLM counts (1 = most likely)."""
    chosen = scores.gather(1, token_ids[:, None])  # [B, 1]
    return (scores >= chosen).sum(dim=1)


def logprobs_of(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> TokenLogprobs:
    """The raw logprobs (log_softmax in float32) of token_ids [P] under logits [P, V], their ranks and the top k."""
    logprobs = torch.log_softmax(logits.float(), dim=1)  # [P, V]
    top_logprobs, top_ids = logprobs.topk(k, dim=1)
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    return TokenLogprobs(chosen, ranks_of(logprobs, token_ids), top_ids, top_logprobs)


def reports_logprobs(params) -> bool:
    """Whether a sequence's token logprobs are read: asked for, or summed to rank best_of's samples."""
    return params.logprobs is not None or params.best_of is not None


def with_raw_logprobs(output: SampleOutput, raw_logits: torch.Tensor, rows: torch.Tensor) -> SampleOutput:
    """`output` with the logprobs of `rows` [M] taken from raw_logits [B, V] instead of the masked logits
    the sampler saw: vLLM's logprobs come from the logits before min_tokens masking."""
    k = output.top_token_ids.shape[1]
    raw = logprobs_of(raw_logits[rows], output.token_ids[rows], k)
    return SampleOutput(
        token_ids=output.token_ids,
        logprobs=output.logprobs.index_put((rows,), raw.logprobs),
        top_token_ids=output.top_token_ids.index_put((rows,), raw.top_ids),
        top_logprobs=output.top_logprobs.index_put((rows,), raw.top_logprobs),
    )
