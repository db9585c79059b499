"""Logprobs in vLLM's shape, as the engine records them: per generated token the flat logprob and top
alternatives, and {token id: Logprob} holding the chosen token (with its rank) and its top alternatives ranked
1..k, each with its text (special tokens spelled out, as vLLM's decoded_token); per prompt token the same."""

from __future__ import annotations

from deepinfer_core.engine.pending import HostPromptLogprobs
from deepinfer_core.engine.request import Logprob, Request, RequestGroup
from deepinfer_core.engine.tokenizer import Tokenizer

__all__ = ["LogprobRecorder"]


class LogprobRecorder:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer

    def _text(self, token: int) -> str | None:
        return self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer is not None else None

    def entry(
        self, token: int, logprob: float, rank: int | None, top_ids: list[int], top_logprobs: list[float]
    ) -> dict[int, Logprob]:
        """vLLM's {token id: Logprob}: the token itself, then its top alternatives ranked 1..k."""
        rank = top_ids.index(token) + 1 if token in top_ids else rank
        entry = {token: Logprob(logprob, rank, self._text(token))}
        for i, (other, other_logprob) in enumerate(zip(top_ids, top_logprobs)):
            entry.setdefault(other, Logprob(other_logprob, i + 1, self._text(other)))
        return entry

    def record(
        self,
        request: Request,
        token: int,
        logprob: float,
        rank: int | None,
        top_ids: list[int],
        top_logprobs: list[float],
    ) -> None:
        """A generated token's logprob and its top alternatives, flat and in vLLM's shape."""
        request.logprobs.append(logprob)
        request.top_logprobs.append(dict(zip(top_ids, top_logprobs)))
        request.sample_logprobs.append(self.entry(token, logprob, rank, top_ids, top_logprobs))

    def record_prompt(self, group: RequestGroup, chunk: HostPromptLogprobs) -> None:
        """The prompt logprobs a prefill chunk computed, into the group's (one entry per prompt position)."""
        prompt = chunk.request.prompt_token_ids
        for i, (logprob, rank, top_ids, top_logprobs) in enumerate(
            zip(chunk.logprobs, chunk.ranks, chunk.top_ids, chunk.top_logprobs)
        ):
            position = chunk.first + i
            group.prompt_logprobs[position] = self.entry(prompt[position], logprob, rank, top_ids, top_logprobs)
