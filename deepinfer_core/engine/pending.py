"""A step in flight: issued to the device, its sampled tokens not yet read back by the host."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deepinfer_core.engine.request import Request
from deepinfer_core.engine.scheduler import ScheduledStep
from deepinfer_core.engine.step_batch import StepOutput
from deepinfer_core.engine.transfer import HostCopy, to_device

if TYPE_CHECKING:
    from deepinfer_core.engine.step_sampling import IssuedStep

__all__ = ["HostPromptLogprobs", "HostResults", "InFlightTokens", "LaunchedStep", "filled"]


@dataclass(frozen=True, slots=True)
class InFlightTokens:
    """What the step still in flight left on the device for the next step: each sampled request's newest token
    and, with speculative decoding, how many drafts it accepted and its drafter's drafts for the next step."""

    token_ids: torch.Tensor  # [R] int64: each request's newest token (past its accepted drafts)
    rows: dict[Request, int]  # request -> its row in token_ids
    accepted: torch.Tensor | None = None  # [R] int64: drafts the request accepted (its positions run ahead by that)
    drafts: torch.Tensor | None = None  # [R, k] int64: the drafts each request's next step verifies
    verified: dict[Request, int] | None = None  # drafts the step verifies per request: the most it may accept

    def values(self) -> torch.Tensor:
        """token_ids, then the drafts row by row: what `source` indexes."""
        if self.drafts is None:
            return self.token_ids
        return torch.cat([self.token_ids, self.drafts.reshape(-1)])

    def source(self, request: Request, draft: int = -1) -> int:
        """Where in `values()` the request's newest token (draft -1) or its draft `draft` (0-based) is."""
        row = self.rows[request]
        return row if draft < 0 else len(self.rows) + row * self.drafts.shape[1] + draft


@dataclass(frozen=True, slots=True)
class HostPromptLogprobs:
    """Logprobs of prompt tokens first.. of a request, read back (one entry per token)."""

    request: Request
    first: int
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass(frozen=True, slots=True)
class HostResults:
    """A step's results on the host; per sampled row unless said otherwise."""

    token_ids: list[int]
    logprobs: list[float]  # raw logprob of the token
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    ranks: list[int] | None  # the token's rank; None when no row asked for logprobs
    prompt_logprobs: list[HostPromptLogprobs]
    drafts: list[list[int]] | None = None  # a draft model's drafts for the next step, per sampled request
    draft_confidence: list[list[float]] | None = None  # and its confidence in each (DSpark), if it gives one


class LaunchedStep:
    """A step whose model's work is issued. Its sampling is issued by then too, or by `issue()` where its
    structured-output masks fill in the background (the engine calls it after its other host work of the step;
    reading the step calls it too). The copy of its results to the host starts then; `read()` waits for that copy
    only, not for steps issued after it."""

    def __init__(self, scheduled: ScheduledStep, issued: IssuedStep) -> None:
        """Made right after the step's model is issued, before its requests' progress is updated."""
        self.scheduled = scheduled
        # one token past the prompt (and its drafts, if it verifies any): decodes; the rest is prefill
        self.num_decode_tokens = sum(
            count
            for request, count in scheduled.requests
            if count == 1 + len(request.draft_token_ids)
            and request.num_computed_tokens >= len(request.prompt_token_ids)
        )
        # the drafts a verify step checks, per request (the requests' own lists change with the next plan)
        self.drafts = {r: list(r.draft_token_ids) for r, _ in scheduled.requests if r.draft_token_ids}
        self.sampled = issued.sampled  # the requests that get a token, in the sampler's row order
        self.prompt_logprobs = issued.prompt_logprobs
        self._issued = issued
        self._output: StepOutput | None = None
        self._host: HostCopy | None = None
        self._results: HostResults | None = None
        # structured outputs: the requests whose grammar took this step's token early (`advance_grammars`), and
        # whether the grammar allowed it
        self.grammar_accepted: dict[Request, bool] = {}

    @property
    def output(self) -> StepOutput:
        """The step's results on the device (its sampling issued)."""
        self.issue()
        return self._output

    def issue(self) -> None:
        """Issue the step's sampling if it is not yet, and start copying its results to the host (once)."""
        if self._output is not None:
            return
        output = self._output = self._issued.finish()
        tokens = output.tokens
        tensors = [tokens.token_ids, tokens.logprobs, tokens.top_token_ids, tokens.top_logprobs] if tokens else []
        if output.ranks is not None:
            tensors.append(output.ranks)
        for chunk in output.prompt_logprobs:
            lp = chunk.logprobs
            tensors += [lp.logprobs, lp.ranks, lp.top_ids, lp.top_logprobs]
        if output.drafts is not None:
            tensors.append(output.drafts)
        if output.draft_confidence is not None:
            tensors.append(output.draft_confidence)
        self._host = HostCopy(tensors)

    def tokens(self) -> InFlightTokens | None:
        """Where the next step finds this step's tokens."""
        output = self.output
        if output.tokens is None:
            return None
        if output.accepted is None:  # one row a request
            return InFlightTokens(output.tokens.token_ids, {r: row for row, r in enumerate(self.sampled)})
        requests = dict.fromkeys(self.sampled)  # a verify step samples a request on several rows
        rows = {r: i for i, r in enumerate(requests)}
        return InFlightTokens(output.newest, rows, output.accepted, output.drafts, self.verified())

    def verified(self) -> dict[Request, int]:
        """Drafts the step verifies per sampled request: the most each may accept (the host learns how many when
        the step is read)."""
        return {request: len(self.drafts.get(request, ())) for request in self.sampled}

    def pipelines_drafts(self) -> bool:
        """Speculating, whether the next step may be planned before this one is read: this one ran decodes only
        (each request's last token and drafts), so the next finds their newest tokens, drafts and accepted counts
        on the device (`tokens`), and none of its requests needs them on the host: penalties count the output
        tokens, and a min_tokens still to reach masks stop tokens by the output's length."""
        if self.num_decode_tokens != self.scheduled.num_tokens:
            return False
        for request, _ in self.scheduled.requests:
            params = request.params
            penalized = params.repetition_penalty != 1 or params.presence_penalty or params.frequency_penalty
            if not request.finished and (penalized or request.masks_stop_tokens()):
                return False
        return True

    def grammar_feed(self):
        """`advance_grammars` where this step sampled a structured-output request, else None."""
        return self.advance_grammars if any(r.grammar is not None for r in self.sampled) else None

    def advance_grammars(self) -> None:
        """Feed this step's tokens to its structured-output requests' grammars now (blocking until the tokens are
        on the host), so that the step issued after it can fill their next masks while its model runs; the
        engine's finalize then takes the outcome instead of feeding them again."""
        if self.grammar_accepted or self.output.tokens is None:
            return
        tokens = self.read().token_ids
        for row, request in enumerate(self.sampled):
            if request.grammar is not None and not request.finished:
                self.grammar_accepted[request] = request.grammar.accept(tokens[row])

    def read(self) -> HostResults:
        """The step's results on the host (blocks until they are here; read once)."""
        if self._results is None:
            self._results = self._read()
        return self._results

    def _read(self) -> HostResults:
        self.issue()
        values = [t.tolist() for t in self._host.wait()]
        tokens = values[:4] if self.output.tokens is not None else [[], [], [], []]
        del values[: 4 if self.output.tokens is not None else 0]
        ranks = values.pop(0) if self.output.ranks is not None else None
        prompt = [
            HostPromptLogprobs(chunk.request, chunk.first, *values[4 * i : 4 * i + 4])
            for i, chunk in enumerate(self.prompt_logprobs)
        ]
        del values[: 4 * len(prompt)]
        drafts = values.pop(0) if self.output.drafts is not None else None
        confidence = values.pop(0) if self.output.draft_confidence is not None else None
        return HostResults(*tokens, ranks, prompt, drafts, confidence)


def filled(tensor: torch.Tensor, at: list[int], sources: list[int], values: torch.Tensor | None) -> torch.Tensor:
    """`tensor` with its entries `at` replaced by `values[sources]`, on the device (a token still in flight)."""
    if at:
        device = tensor.device
        tensor[to_device(at, device)] = values[to_device(sources, device)]
    return tensor
