"""A request's state inside the engine, and what the engine reports back about it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from deepinfer_core.sampling.params import SamplingParams

__all__ = ["CompletionOutput", "Logprob", "Request", "RequestOutput", "RequestStatus"]


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
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it

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
    cumulative_logprob: float | None = None
    new_text: str = ""  # text added since this sample's previous report (for streaming)
    new_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    # vLLM's shape: None for the first prompt token, then {token id: Logprob} per prompt token
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def new_text(self) -> str:
        """The first sample's text delta (requests with n = 1 have one sample)."""
        return self.outputs[0].new_text

    @property
    def new_token_ids(self) -> tuple[int, ...]:
        return self.outputs[0].new_token_ids

    @classmethod
    def of(cls, request: Request, new_text: str = "", new_token_ids: tuple[int, ...] = ()) -> RequestOutput:
        wants_logprobs = request.params.logprobs is not None
        completion = CompletionOutput(
            text=request.text,
            token_ids=tuple(request.output_token_ids),
            token_logprobs=tuple(request.logprobs) if wants_logprobs else None,
            top_logprobs=tuple(request.top_logprobs) if wants_logprobs else None,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=list(request.sample_logprobs) if wants_logprobs else None,
            cumulative_logprob=request.cumulative_logprob if wants_logprobs else None,
            new_text=new_text,
            new_token_ids=new_token_ids,
        )
        return cls(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=tuple(request.prompt_token_ids),
            outputs=[completion],
            finished=request.finished,
            num_cached_tokens=request.num_cached_tokens,
        )
