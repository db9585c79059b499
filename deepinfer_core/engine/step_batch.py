"""What one step carries between the runner's phases and the engine: its prepared inputs (`StepBatch`, with the
prompt spans owed logprobs and a draft model's host-built inputs) and what it computed (`StepOutput`), on the
device. engine/runner.py builds and fills them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_core.backend.ops import AttentionMetadata
from deepinfer_core.engine.request import Request
from deepinfer_core.sampling.logprobs import TokenLogprobs
from deepinfer_core.sampling.sampler import SampleOutput

__all__ = ["DraftingInputs", "PromptLogprobs", "PromptSpan", "StepBatch", "StepOutput"]


@dataclass(frozen=True, slots=True)
class PromptSpan:
    """Prompt tokens whose logprobs a step computes: tokens first..first+count-1 of the request's prompt,
    from the hidden states of the positions before them, rows hidden_row.. of the step's [T]."""

    request: Request
    first: int
    count: int
    hidden_row: int


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    request: Request
    first: int  # the prompt index of the first token in `logprobs`
    logprobs: TokenLogprobs  # on the device


@dataclass(frozen=True, slots=True)
class DraftingInputs:
    """The host-built part of a draft model's inputs for one step, on the device."""

    next_ids: torch.Tensor  # [T] the token after each position (0 where the step samples it)
    expected: torch.Tensor  # [rows] the draft each sampled row checks (-1: none, the request's last row)
    first_row: torch.Tensor  # [R] each sampled request's first sampled row
    seq_index: torch.Tensor  # [R] its sequence in the step
    num_drafts: torch.Tensor  # [R] the drafts it verifies
    position_limit: torch.Tensor  # [R] the last position its blocks and the model's positions hold
    max_drafts: int


@dataclass(frozen=True, slots=True)
class StepBatch:
    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: list[int]  # index into the step's requests of those that get a new token
    last_token_index: torch.Tensor  # [S] index in [T] of each sampled request's last token
    sampled: list[Request]  # the requests of sample_rows, in that order
    prompt_spans: tuple[PromptSpan, ...] = ()  # prompt tokens owed logprobs (prompt_logprobs) this step
    # per sampled row, how many of its request's drafted tokens precede it (a verify step samples a request's
    # last token and each of its drafts: rows 0..k); () when nothing is drafted
    draft_offsets: tuple[int, ...] = ()
    drafting: DraftingInputs | None = None  # what a draft model reads of the step (a drafter is loaded)
    # [S] how many drafts the step in flight accepted for each sampled row's request, or None when the host knows
    # every position: a row's output index runs ahead of what the host counts by that (engine: pipelined steps)
    ahead: torch.Tensor | None = None

    def outputs(self, row: int) -> list[int]:
        """The output tokens sampled row `row` follows (its request's, then the drafts before it)."""
        request = self.sampled[row]
        if not self.draft_offsets or not self.draft_offsets[row]:
            return request.output_token_ids
        return request.output_token_ids + request.draft_token_ids[: self.draft_offsets[row]]


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What a step computed, on the device: tokens for the requests that got one, and prompt logprobs."""

    sampled: list[Request]  # the requests that got a token, in the sampler's row order
    tokens: SampleOutput | None
    ranks: torch.Tensor | None  # [S] rank of each sampled token; None when no row asked for logprobs
    prompt_logprobs: list[PromptLogprobs]
    drafts: torch.Tensor | None = None  # [R, k] a draft model's drafts for the next step, per sampled request
    draft_confidence: torch.Tensor | None = None  # [R, k] float32 its P(accepted | those before), if it says
    accepted: torch.Tensor | None = None  # [R] int64 drafts each sampled request accepted (with a draft model)
    newest: torch.Tensor | None = None  # [R] int64 its newest token: the one sampled after its accepted drafts
