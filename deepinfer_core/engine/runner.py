"""Runs one scheduled step: builds the ragged batch and its cache metadata, runs the model, samples.

Everything here is device-agnostic: tensors go to `backend.torch_device`, compute goes through the
objects the backend's hooks returned at engine build. Nothing here waits for the device: a token that
the step still in flight sampled is taken from that step's token tensor, on the device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from deepinfer_core.backend.extensions import LogitsProcessor
from deepinfer_core.backend.ops import AttentionMetadata
from deepinfer_core.backend.resolve import ResolvedBackend
from deepinfer_core.engine.drafting import accepted_drafts, drafting_inputs
from deepinfer_core.engine.graphs import DecodeGraphs
from deepinfer_core.engine.pending import InFlightTokens, filled
from deepinfer_core.engine.request import Request
from deepinfer_core.engine.snapshots import first_needed
from deepinfer_core.engine.step_batch import PromptLogprobs, PromptSpan, StepBatch, StepOutput
from deepinfer_core.engine.step_sampling import IssuedStep, StepSampling
from deepinfer_core.engine.transfer import to_device
from deepinfer_core.kv.caches import allocate_caches
from deepinfer_core.sampling.logprobs import TokenLogprobs, logprobs_of
from deepinfer_core.sampling.sampler import SampleOutput
from deepinfer_core.structured.stats import StructuredOutputStats

__all__ = ["ModelRunner", "PromptLogprobs", "PromptSpan", "StepBatch", "StepOutput"]

_PROMPT_LOGITS_ROWS = 512  # prompt positions turned into logits [rows, V] at a time (bounds the memory)


class ModelRunner:
    def __init__(
        self,
        model,
        backend: ResolvedBackend,
        num_blocks: int,
        logits_processors: Sequence[LogitsProcessor] = (),
        *,
        graph_batch_size: int = 0,
        max_model_len: int = 0,
        num_seq_slots: int = 64,
        drafter=None,
        num_draft_tokens: int = 0,
        rejection: bool = False,
    ) -> None:
        """graph_batch_size > 0 replays decode steps of up to that many sequences from device graphs,
        where the backend can capture them; the caches then get one scratch block (and sequence slot) for
        padding rows.
        Per-sequence caches get `num_seq_slots` slots (the scheduler's max_num_seqs).
        drafter: a draft model (model/mtp.py, mtp_v4.py, dspark.py) run after every step to draft `num_draft_tokens`
        tokens per sampled request; its caches follow the model's. Verify steps (each request's last token and
        drafts) replay graphs too, every sequence padded to the step's most tokens (the scheduler allocates
        KV slots for that: its lookahead).
        rejection: a row that checks a draft keeps it by rejection sampling (sampling/rejection.py), not by
        equality with the token sampled there."""
        self.model, self.backend, self.sampler = model, backend, backend.sampler
        self.device = backend.torch_device
        self.block_size = backend.kv_layout.block_size
        self.drafter, self.num_draft_tokens, self.rejection = drafter, num_draft_tokens, rejection
        use_graphs = backend.graphs is not None and graph_batch_size > 0 and getattr(model, "graph_capture", False)
        # graphs: block `num_blocks` and sequence slot `num_seq_slots` are the padding rows' scratch
        units, seq_units = (num_blocks + 1, num_seq_slots + 1) if use_graphs else (num_blocks, num_seq_slots)
        specs = model.cache_specs + (drafter.cache_specs if drafter is not None else [])
        self.caches = allocate_caches(backend.kv_layout, specs, units, seq_units)
        self.max_position = getattr(model.config, "max_position_embeddings", 1 << 62) - 1
        self.logits_processors = list(logits_processors)
        self.snapshot_boundaries = False  # the engine keeps window snapshots: see snapshots.first_needed
        self.structured_stats: StructuredOutputStats | None = None  # the engine's, once structured outputs are used
        self.lockstep = None  # a data-parallel rank's MoELockstep (parallel/lockstep.py): forwards keep ranks in step
        self.graphs = None
        if use_graphs:
            self.graphs = DecodeGraphs(
                backend.graphs,
                model,
                self.caches,
                device=self.device,
                block_size=self.block_size,
                max_batch=graph_batch_size,
                max_blocks_per_seq=-(-max_model_len // self.block_size),
                scratch_block=num_blocks,
                scratch_seq_slot=num_seq_slots,
                max_queries=1 + num_draft_tokens,
                drafter=drafter,
            )

    def prepare(self, scheduled: Sequence[tuple[Request, int]], in_flight: InFlightTokens | None = None) -> StepBatch:
        """The step's inputs on the device. A request's newest token may be one `in_flight` sampled; with speculative
        decoding its drafts then are in flight too, and its positions run ahead of the host's count by the drafts
        that step accepts (`InFlightTokens.accepted`): they are moved on the device (positions, slots, lengths and
        the sampler's output indices)."""
        token_ids, positions, slots, starts, seq_lens, tables, sample_rows, last = [], [], [], [0], [], [], [], []
        seq_slots, window_starts, cached_lens, needed_from, prompt_spans = [], [], [], [], []
        fill_at, fill_from = [], []  # index in token_ids <- index in in_flight.values()
        ahead_rows = []  # per sequence: its row in in_flight.accepted, or -1 (the host knows its positions)
        offsets = []  # per sampled row, the drafts before it
        uniform = self._uniform_queries(scheduled, in_flight)
        for row, (request, count) in enumerate(scheduled):
            begin, end = request.num_computed_tokens, request.num_computed_tokens + count
            drafts = request.draft_token_ids  # verified after the request's last token
            end_known = end - len(drafts)
            pad = uniform - count if uniform else 0  # filler tokens after them, checked by no row
            token_ids += request.all_token_ids[begin:end_known]
            ahead_rows.append(-1)
            if end_known > request.num_known_tokens:  # its last token is still on the device
                if end_known != request.num_known_tokens + 1 or in_flight is None or request not in in_flight.rows:
                    raise RuntimeError(f"request {request.request_id}: step input not on the host nor in flight")
                fill_at.append(len(token_ids))
                fill_from.append(in_flight.source(request))
                if in_flight.accepted is not None:  # speculating: its drafts are the ones drafted in flight
                    ahead_rows[-1] = in_flight.rows[request]
                    fill_at += range(len(token_ids) + 1, len(token_ids) + 1 + len(drafts))
                    fill_from += [in_flight.source(request, j) for j in range(len(drafts))]
                token_ids.append(0)  # placeholders, replaced on the device
            token_ids += drafts
            if request.needs_prompt_logprobs:  # token t's logprob comes from position t - 1's logits
                first = max(begin, request.num_prompt_logprobs) + 1
                count_scored = min(end, len(request.prompt_token_ids) - 1) + 1 - first
                if count_scored > 0:
                    prompt_spans.append(PromptSpan(request, first, count_scored, starts[-1] + first - 1 - begin))
            token_ids += [0] * pad
            positions += range(begin, end + pad)
            slots += [
                request.block_ids[p // self.block_size] * self.block_size + p % self.block_size
                for p in range(begin, end + pad)
            ]
            starts.append(starts[-1] + count + pad)
            seq_lens.append(end + pad)
            tables.append(request.block_ids)
            seq_slots.append(request.seq_slot)
            window_starts.append(request.window_start)
            cached_lens.append(request.num_cached_tokens)
            needed_from.append(first_needed(request, self.block_size, self.snapshot_boundaries))
            if end_known == request.num_tokens:  # the step reaches its last token: sample the next one
                for j in range(len(drafts) + 1):  # and after each draft: the tokens that verify them
                    sample_rows.append(row)
                    last.append(starts[-1] - 1 - pad - len(drafts) + j)
                    offsets.append(j)
        width = max(len(t) for t in tables)
        block_tables = torch.full((len(tables), width), -1, dtype=torch.int64)
        for row, table in enumerate(tables):
            block_tables[row, : len(table)] = torch.tensor(table, dtype=torch.int64)

        device = self.device
        values = in_flight.values() if fill_at else None
        tokens = filled(to_device(token_ids, device), fill_at, fill_from, values)  # [T]
        fields = (starts, seq_lens, block_tables, slots, seq_slots, window_starts, cached_lens, needed_from)
        on_device = [to_device(v, device) for v in fields]
        token_positions = to_device(positions, device)
        ahead = None
        if any(r >= 0 for r in ahead_rows):  # shift the sequences whose drafts in flight may be accepted
            ran = torch.cat([in_flight.accepted, in_flight.accepted.new_zeros(1)])  # the last: the host's own
            ran = ran[to_device([r if r >= 0 else len(in_flight.rows) for r in ahead_rows], device)]  # [B]
            seq_of_token = to_device([i for i in range(len(scheduled)) for _ in range(starts[i + 1] - starts[i])],
                                     device)  # fmt: skip
            token_positions = token_positions + ran[seq_of_token]
            blocks = on_device[2][seq_of_token, token_positions // self.block_size]
            on_device[3] = blocks * self.block_size + token_positions % self.block_size  # slots
            on_device[1] = on_device[1] + ran  # seq_lens
            ahead = ran[to_device(sample_rows, device)]
        max_query_len = max(b - a for a, b in zip(starts, starts[1:]))
        meta = AttentionMetadata(*on_device, max_query_len=max_query_len, uniform_decode=uniform is not None)
        sampled = [scheduled[row][0] for row in sample_rows]
        last_index = to_device(last, device)
        drafting = None
        if self.drafter is not None:
            drafting = drafting_inputs(
                scheduled, sample_rows, offsets, uniform, ahead_rows, in_flight, values,
                block_size=self.block_size, max_position=self.max_position, device=device,
            )  # fmt: skip
        return StepBatch(
            tokens,
            token_positions,
            meta,
            sample_rows,
            last_index,
            sampled,
            tuple(prompt_spans),
            tuple(offsets) if any(offsets) else (),
            drafting,
            ahead,
        )

    def _uniform_queries(
        self, scheduled: Sequence[tuple[Request, int]], in_flight: InFlightTokens | None = None
    ) -> int | None:
        """q when the step is uniform (AttentionMetadata.uniform_decode): every request runs its last token and
        its drafts (q at most 1 + num_draft_tokens), none of them in its cached prefix or a replay, none owed
        prompt logprobs, and all the same number of them, or the step replays a graph and each is padded to
        the most, q (its KV blocks and the model's positions hold the filler, also where the request's drafts in
        flight are all accepted); None otherwise."""
        counts = [count for _, count in scheduled]
        most = max(counts)
        if most > 1 + self.num_draft_tokens:
            return None
        for request, count in scheduled:
            begin = request.num_computed_tokens
            if begin < max(request.num_cached_tokens, request.window_start) or request.needs_prompt_logprobs:
                return None
            if begin + count - len(request.draft_token_ids) != request.num_tokens:  # its last token, then drafts
                return None
        if min(counts) == most:
            return most
        width = max(len(request.block_ids) for request, _ in scheduled)
        if self.graphs is None or not self.graphs.fits(len(scheduled), width, most):
            return None
        verified = in_flight.verified if in_flight is not None and in_flight.verified is not None else {}
        for request, _ in scheduled:
            ahead = verified.get(request, 0)  # drafts in flight: all may be accepted
            last = request.num_computed_tokens + ahead + most - 1
            if last >= len(request.block_ids) * self.block_size or last > self.max_position:
                return None
        return most

    def _processed_logits(self, logits: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        if not self.logits_processors:
            return logits
        rows = []
        for i, (row, request) in enumerate(zip(logits, batch.sampled)):
            for processor in self.logits_processors:
                row = processor(request.prompt_token_ids, batch.outputs(i), row)
            rows.append(row)
        return torch.stack(rows)

    @torch.inference_mode()
    def run_model(self, batch: StepBatch) -> tuple[torch.Tensor, list[PromptLogprobs]]:
        """Logits [S, V] float32 of the batch's sampled rows, after the logits processors, and the
        logprobs of its prompt spans (from the model's logits). The only place the model runs."""
        return self._run_model(batch)[:2]

    def _run_model(self, batch: StepBatch) -> tuple[torch.Tensor, list[PromptLogprobs], torch.Tensor | None]:
        """run_model's results and what a drafter reads of the step (`target_forward`; without one the final
        hidden states [T, D], or None when a device graph ran the step)."""
        meta = batch.meta
        if self._replayed(meta):
            logits, drafted = self.graphs.run(batch.token_ids, batch.positions, meta)  # [T, V], rows in step order
            if meta.max_query_len > 1:  # a verify step: padding rows are sampled by none
                logits = logits[batch.last_token_index]
            return self._processed_logits(logits, batch).float(), [], drafted
        if self.lockstep is not None:
            self.lockstep.begin()
        if self.drafter is None:
            hidden = drafted = self.model.forward(batch.token_ids, batch.positions, meta, self.caches)  # [T, D]
        else:  # and what the drafter reads of each position
            hidden, drafted = self.drafter.target_forward(self.model, batch.token_ids, batch.positions, meta,
                                                          self.caches)  # fmt: skip
        if self.lockstep is not None:
            self.lockstep.complete()
        prompt = [self._prompt_logprobs(hidden, span) for span in batch.prompt_spans]
        if not batch.sampled:
            return hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32), prompt, drafted
        logits = self.model.logits(hidden[batch.last_token_index])  # [S, V]
        return self._processed_logits(logits, batch).float(), prompt, drafted

    def _replayed(self, meta: AttentionMetadata) -> bool:
        """Whether a step of `meta` replays a device graph (a uniform step that fits the captured shapes)."""
        graphs = self.graphs
        return (
            meta.uniform_decode
            and graphs is not None
            and graphs.fits(meta.num_seqs, meta.block_tables.shape[1], meta.max_query_len)
        )

    def _prompt_logprobs(self, hidden: torch.Tensor, span: PromptSpan) -> PromptLogprobs:
        """Logprobs of a span's prompt tokens and their top `prompt_logprobs` alternatives, from hidden [T, D]."""
        request, k = span.request, span.request.params.prompt_logprobs
        targets = to_device(request.prompt_token_ids[span.first : span.first + span.count], self.device)  # [P]
        rows = hidden[span.hidden_row : span.hidden_row + span.count]  # [P, D]
        step = _PROMPT_LOGITS_ROWS
        parts = [
            logprobs_of(self.model.logits(rows[i : i + step]), targets[i : i + step], k)
            for i in range(0, span.count, step)
        ]
        return PromptLogprobs(request, span.first, TokenLogprobs.cat(parts))

    def sample(
        self, batch: StepBatch, logits: torch.Tensor, in_flight: InFlightTokens | None = None
    ) -> tuple[SampleOutput, torch.Tensor | None]:
        """One token per sampled row of `batch` from its logits [S, V], and the rank of each (`StepSampling`)."""
        stats = self.structured_stats
        return StepSampling(batch, logits, in_flight, self.sampler, self.device, stats, self.rejection).finish()

    def execute(
        self,
        scheduled: Sequence[tuple[Request, int]],
        in_flight: InFlightTokens | None = None,
        before_sampling: Callable[[], None] | None = None,
    ) -> StepOutput:
        """Run the step: its tokens and logprobs stay on the device (`launch`, its sampling issued)."""
        return self.launch(scheduled, in_flight, before_sampling).finish()

    def launch(
        self,
        scheduled: Sequence[tuple[Request, int]],
        in_flight: InFlightTokens | None = None,
        before_sampling: Callable[[], None] | None = None,
    ) -> IssuedStep:
        """Issue the step's model and its sampling, except while its structured-output masks fill in the background:
        then `finish()` on the result issues the sampling (the caller's other host work runs meanwhile).
        `before_sampling` runs after the model's work is issued and before the sampling is prepared (structured
        outputs: the previous step's tokens reach the grammars)."""
        batch = self.prepare(scheduled, in_flight)
        if self.drafter is None:
            logits, prompt_logprobs = self.run_model(batch)  # [S, V]
        else:
            logits, prompt_logprobs, hidden = self._run_model(batch)
        if not batch.sampled:
            if self.drafter is not None:  # prefill chunks: the drafter's cache follows the model's
                self._draft(batch, hidden, None)
            return IssuedStep([], prompt_logprobs, StepOutput([], None, None, prompt_logprobs))
        if before_sampling is not None:
            before_sampling()
        stats = self.structured_stats
        sampling = StepSampling(batch, logits, in_flight, self.sampler, self.device, stats, self.rejection)
        if self.drafter is None:
            issued = IssuedStep(batch.sampled, prompt_logprobs, lambda: StepOutput(batch.sampled, *sampling.finish(),
                                                                                   prompt_logprobs))  # fmt: skip
            if sampling.masks is None or not sampling.masks.in_background:
                issued.finish()
            return issued
        tokens, ranks = sampling.finish()  # the drafter drafts from the tokens at once
        accepted = accepted_drafts(batch.drafting, tokens.token_ids)
        drafts = self._draft(batch, hidden, tokens.token_ids, accepted)
        confidence = None
        if isinstance(drafts, tuple):  # a drafter with a confidence head (DSpark)
            drafts, confidence = drafts
        newest = tokens.token_ids[batch.drafting.first_row + accepted]
        output = StepOutput(batch.sampled, tokens, ranks, prompt_logprobs, drafts, confidence, accepted, newest)
        return IssuedStep(batch.sampled, prompt_logprobs, output)

    @torch.inference_mode()
    def _draft(
        self, batch: StepBatch, hidden: torch.Tensor, sampled: torch.Tensor | None, accepted: torch.Tensor | None = None
    ):
        """Run the drafter over the step (its cache catches up) and draft from each sampled request's last
        accepted position (`accepted` [R] drafts past its first sampled row) -> [R, k], or (that, confidences
        [R, k]) from a drafter with a confidence head, or None when nothing was sampled."""
        from deepinfer_core.model.mtp import DraftInputs  # a model module: the runner needs it only here

        d = batch.drafting
        meta = batch.meta
        if sampled is not None and self._replayed(meta):  # the target ran in a graph: draft in its draft graph
            padded = torch.zeros_like(batch.token_ids).index_put_((batch.last_token_index,), sampled)
            return self.graphs.draft(padded, d.num_drafts, d.position_limit, self.num_draft_tokens)
        next_ids = d.next_ids.clone()
        caches = self.caches[len(self.model.cache_specs) :]  # the drafter's, after the model's
        if sampled is None:  # nothing sampled: catch up only
            self.drafter.forward(next_ids, batch.positions, hidden, batch.meta, caches)
            return None
        next_ids[batch.last_token_index] = sampled  # a verify row's next token is the token it sampled
        inputs = DraftInputs(
            next_ids, batch.positions, hidden, batch.meta, batch.last_token_index, d.first_row, d.seq_index,
            accepted, d.position_limit, self.block_size,
        )  # fmt: skip
        return self.drafter.draft(inputs, caches, self.num_draft_tokens)
