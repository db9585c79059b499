"""A request's state inside the engine, and what the engine reports back about it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deepinfer_core.sampling.params import SamplingParams

if TYPE_CHECKING:
    from deepinfer_core.structured.grammars import GrammarState

__all__ = ["CompletionOutput", "FailedRequest", "Logprob", "Request", "RequestGroup", "RequestOutput", "RequestStatus"]


@dataclass(frozen=True, slots=True)
class Logprob:
    """vLLM's Logprob: a token's raw logprob, its rank among the vocabulary (1 = most likely; None when
    unknown) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Request:
    """One sequence: a request with n = 1, or one sample of a request with several (same request_id,
    its own `index`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the request's seed, or one drawn for it on arrival
    arrival: int  # admission order; preemption takes the latest arrival first
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    sample_logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # vLLM's shape, built as tokens come
    cumulative_logprob: float = 0.0
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache at admission
    # the first position computed since admission: below it, the per-sequence caches (windows, state)
    # hold nothing of this request; a prefix hit replays from num_cached_tokens - the model's replay span
    window_start: int = 0
    seq_slot: int = -1  # the request's slot in per-sequence caches while it holds blocks
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # hash chain of this request's full blocks
    num_preemptions: int = 0
    num_pending_tokens: int = 0  # sampled by steps still in flight: counted, but not yet known on the host
    max_num_tokens: int = 1 << 62  # the most tokens the sequence may reach (prompt + max_tokens, capped by the context)
    text: str = ""
    num_reported_chars: int = 0  # of text, reported so far (a possible stop string's start is held back)
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    index: int = 0  # which of its request's samples this sequence is
    min_tokens_masked: tuple[int, ...] = ()  # token ids that cannot be sampled before params.min_tokens (EOS, stop ids)
    num_prompt_logprobs: int = 0  # prompt tokens (from the second) whose logprobs a launched step computed
    pending_snapshot: object | None = None  # a snapshots.PendingSnapshot waiting for its block's hash
    draft_token_ids: list[int] = field(default_factory=list)  # drafted tokens the scheduled step verifies
    next_draft_token_ids: list[int] = field(default_factory=list)  # a draft model's, for the next step
    next_draft_confidence: list[float] = field(default_factory=list)  # its P(accepted | those before), if given
    grammar: GrammarState | None = None  # structured outputs: where the output is in its grammar

    @property
    def num_tokens(self) -> int:
        """Tokens in the sequence, those still in flight included: what the scheduler plans with."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host has: the prompt and the output tokens read back so far."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """The known tokens (`num_known_tokens` of them)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed: the prompt is computed, not read from the prefix cache."""
        return self.params.prompt_logprobs is not None and self.num_prompt_logprobs < len(self.prompt_token_ids) - 1

    def masks_stop_tokens(self, drafts: int = 0) -> bool:
        """The token sampled next (after `drafts` drafted tokens) is still within min_tokens: EOS and stop
        token ids are masked."""
        return (
            bool(self.min_tokens_masked)
            and len(self.output_token_ids) + self.num_pending_tokens + drafts < self.params.min_tokens
        )


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One sample of a request (vLLM's CompletionOutput, plus flat views of the logprobs)."""

    text: str
    token_ids: tuple[int, ...]
    token_logprobs: tuple[float, ...] | None  # raw logprob of each generated token, when asked for
    top_logprobs: tuple[dict[int, float], ...] | None  # the top `logprobs` alternatives of each token
    finish_reason: str | None
    stop_reason: str | int | None
    index: int = 0  # which of the request's n samples
    # vLLM's shape: per generated token {token id: Logprob} holding the chosen token and the top alternatives
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None  # None unless logprobs were asked for (as vLLM)
    new_text: str = ""  # text added since this sample's previous report (for streaming)
    new_token_ids: tuple[int, ...] = ()

    @classmethod
    def of(
        cls, request: Request, index: int, new_text: str = "", new_token_ids: tuple[int, ...] = ()
    ) -> CompletionOutput:
        wants_logprobs = request.params.logprobs is not None
        return cls(
            text=request.text,
            token_ids=tuple(request.output_token_ids),
            token_logprobs=tuple(request.logprobs) if wants_logprobs else None,
            top_logprobs=tuple(request.top_logprobs) if wants_logprobs else None,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            index=index,
            logprobs=list(request.sample_logprobs) if wants_logprobs else None,
            cumulative_logprob=request.cumulative_logprob if wants_logprobs else None,
            new_text=new_text,
            new_token_ids=new_token_ids,
        )


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: list[CompletionOutput]  # the samples this report is about, ordered by index
    finished: bool
    num_cached_tokens: int
    # vLLM's shape: None for the first prompt token, then {token id: Logprob} per prompt token
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def new_text(self) -> str:
        """The first listed sample's text delta (requests with n = 1 have one sample)."""
        return self.outputs[0].new_text

    @property
    def new_token_ids(self) -> tuple[int, ...]:
        return self.outputs[0].new_token_ids


@dataclass(frozen=True, slots=True)
class FailedRequest:
    """A report in a step's outputs that a request ended without output: `error` says why (a RequestError for
    bad input, a DeepInferError otherwise). The multi-rank front (parallel/data_parallel.py) reports a request a
    rank refused, or that could not be recomputed, this way; the callers raise `error` for that request alone."""

    request_id: str
    error: Exception
    finished: bool = True


Delta = tuple[str, tuple[int, ...]]  # (new text, new token ids) of one sample in one step


@dataclass(eq=False, slots=True)
class RequestGroup:
    """A request as added: its samples, one sequence each (`SamplingParams.fan_out`), and its prompt logprobs.

    Samples after the first are `held` until the first one's prompt is in the prefix cache, so they read
    the prompt's KV from there instead of computing it again.
    """

    request_id: str
    prompt: str | None
    params: SamplingParams  # as the request gave them (n, best_of)
    samples: list[Request]
    held: list[Request] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # filled as the prompt is computed

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    def report(self, deltas: dict[int, Delta]) -> RequestOutput | None:
        """What one step changed: the samples with a delta (by sample index). The last report lists the n
        final samples; with best_of > n those are the n of highest cumulative logprob, best first and
        re-indexed 0..n-1, each carrying its whole text as its delta, and nothing is reported before it
        (which samples are kept is known only at the end)."""
        n, finished = self.params.n, self.finished
        if len(self.samples) > n:
            if not finished:
                return None
            best = sorted(self.samples, key=lambda s: -s.cumulative_logprob)[:n]  # stable: ties keep index order
            outputs = [CompletionOutput.of(s, i, s.text, tuple(s.output_token_ids)) for i, s in enumerate(best)]
        else:
            shown = self.samples if finished else [s for s in self.samples if s.index in deltas]
            outputs = [CompletionOutput.of(s, s.index, *deltas.get(s.index, ("", ()))) for s in shown]
        first = self.samples[0]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=tuple(first.prompt_token_ids),
            outputs=outputs,
            finished=finished,
            num_cached_tokens=first.num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs,
        )
