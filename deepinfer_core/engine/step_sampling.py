"""A step's sampling: what it reads of the requests on the host (the sampling batch, min_tokens masks,
structured outputs' masks), then its work on the device (`StepSampling.finish`). While structured outputs' masks
fill in the background the engine does the rest of its host work for the step (the previous step's tokens read,
detokenized, reported) before issuing the sampling (`IssuedStep`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from deepinfer_core.engine.pending import InFlightTokens
from deepinfer_core.engine.request import Request
from deepinfer_core.engine.step_batch import PromptLogprobs, StepBatch, StepOutput
from deepinfer_core.engine.transfer import to_device
from deepinfer_core.sampling.logprobs import ranks_of, reports_logprobs, with_raw_logprobs
from deepinfer_core.sampling.rejection import rejection_tokens, select_rows
from deepinfer_core.sampling.sampler import SampleOutput, SamplingBatch
from deepinfer_core.structured.masks import grammar_masks
from deepinfer_core.structured.stats import StructuredOutputStats

__all__ = ["IssuedStep", "StepSampling"]


class StepSampling:
    """One token per sampled row of `batch` from its logits [S, V], and the rank of each among them (None when no
    row asked for logprobs). Penalties count every output token, those `in_flight` sampled included: they are
    copied in on the device. Rows within min_tokens cannot sample EOS or a stop token id; their logprobs are still
    the unmasked logits' (as vLLM's). rejection: a row that checks a draft keeps it by rejection sampling.
    Everything that reads the requests' host state is done when made; `finish` issues the device's work."""

    @torch.inference_mode()
    def __init__(
        self,
        batch: StepBatch,
        logits: torch.Tensor,
        in_flight: InFlightTokens | None,
        sampler,
        device: torch.device,
        structured_stats: StructuredOutputStats | None = None,
        rejection: bool = False,
    ) -> None:
        self.batch, self.logits, self.sampler, self.device = batch, logits, sampler, device
        sampled = batch.sampled
        sampling = SamplingBatch.build(
            [r.params for r in sampled],
            [r.seed for r in sampled],
            [r.prompt_token_ids for r in sampled],
            [batch.outputs(i) + [0] * r.num_pending_tokens for i, r in enumerate(sampled)],  # 0: replaced below
            device,
        )
        # (row, column in output_tokens, row in in_flight) of each output token still on the device
        pending = [
            (i, len(r.output_token_ids), in_flight.rows[r]) for i, r in enumerate(sampled) if r.num_pending_tokens
        ]
        if pending and sampling.any_penalty:  # the token lists exist only for the penalties
            rows, columns, sources = to_device(pending, device).unbind(1)  # [P] each
            sampling.output_tokens[rows, columns] = in_flight.token_ids[sources]
        if batch.ahead is not None:  # drafts accepted in flight: each row's output index is that much further
            sampling = dataclasses.replace(sampling, steps=sampling.steps + batch.ahead)
        self.sampling = sampling
        offsets = batch.draft_offsets or (0,) * len(sampled)
        masked_rows = [i for i, r in enumerate(sampled) if r.masks_stop_tokens(offsets[i])]
        self.seen = self._mask_stop_tokens(logits, masked_rows, sampled) if masked_rows else logits
        self.masks = grammar_masks(sampled, batch.draft_offsets, device, structured_stats)
        constrained = self.masks.rows if self.masks is not None else []
        # the raw (unmasked) logprobs where they are reported: logprobs asked for, or best_of's ranking
        self.raw_rows = [i for i in sorted(set(masked_rows) | set(constrained)) if reports_logprobs(sampled[i].params)]
        self.wants_ranks = any(r.params.logprobs is not None for r in sampled)
        self.rejected = self._rejection_rows() if rejection and batch.draft_offsets else None

    def _mask_stop_tokens(self, logits: torch.Tensor, rows: list[int], requests: Sequence[Request]) -> torch.Tensor:
        """logits [S, V] with each of `rows`' EOS and stop token ids at -inf (min_tokens not reached yet)."""
        at = [(row, token) for row in rows for token in requests[row].min_tokens_masked]
        index = to_device(at, self.device).unbind(1)  # ([M], [M])
        return logits.index_put(index, torch.full((), float("-inf"), device=logits.device))  # a fill: no copy

    def _rejection_rows(self) -> tuple[list[int], list[int]] | None:
        """(rows, drafts): the rows that check a draft, and the draft each checks."""
        rows, drafts = [], []
        for i, (request, offset) in enumerate(zip(self.batch.sampled, self.batch.draft_offsets)):
            if offset < len(request.draft_token_ids):
                rows.append(i)
                drafts.append(request.draft_token_ids[offset])
        return (rows, drafts) if rows else None

    @torch.inference_mode()
    def finish(self) -> tuple[SampleOutput, torch.Tensor | None]:
        """Issue the sampling (once the structured-output masks are filled): (tokens, ranks), on the device."""
        seen = self.masks.apply(self.sampler, self.seen) if self.masks is not None else self.seen
        output = self.sampler.sample(seen, self.sampling)
        if self.raw_rows:
            output = with_raw_logprobs(output, self.logits, to_device(self.raw_rows, self.device))
        if self.rejected is not None:
            output = self._rejection(seen, output)
        return output, ranks_of(self.logits, output.token_ids) if self.wants_ranks else None

    def _rejection(self, seen: torch.Tensor, output: SampleOutput) -> SampleOutput:
        """Rejection sampling: the rows that check a draft take `rejection_tokens`' token (and its raw logprob)."""
        rows, drafts = self.rejected
        index = to_device(rows, self.device)
        tokens = rejection_tokens(seen[index], select_rows(self.sampling, index), to_device(drafts, self.device))
        raw = torch.log_softmax(self.logits[index], dim=1).gather(1, tokens[:, None])[:, 0]
        return dataclasses.replace(
            output,
            token_ids=output.token_ids.index_put((index,), tokens),
            logprobs=output.logprobs.index_put((index,), raw),
        )


class IssuedStep:
    """A step whose model's work is issued: the requests it samples (in the sampler's row order) and its prompt
    logprobs are known; `finish()` issues its sampling (once, if not yet) and returns its StepOutput."""

    def __init__(
        self,
        sampled: list[Request],
        prompt_logprobs: list[PromptLogprobs],
        finish: Callable[[], StepOutput] | StepOutput,
    ) -> None:
        self.sampled, self.prompt_logprobs = sampled, prompt_logprobs
        self._finish, self._output = (None, finish) if isinstance(finish, StepOutput) else (finish, None)

    def finish(self) -> StepOutput:
        if self._output is None:
            self._output = self._finish()
        return self._output
