"""The engine: requests in, steps run, outputs out. Scheduler, blocks and runner are wired here once.

With asynchronous scheduling, `step()` issues step N (plan on the host, inputs, model, sampler; the
sampled tokens stay on the device) and only then reads back step N-1's tokens and reports them, so
the device never waits for the host between steps. Step N plans with a placeholder for each token of
step N-1 and takes its value on the device. Stops are seen one step late: a request that stopped at
step N-1 may be in step N, whose token for it is dropped. What callers see is what synchronous
scheduling gives. Penalties count the in-flight token (copied in on the device); logits processors
read output tokens on the host, so with any loaded the engine schedules synchronously.

With speculative decoding (`EngineConfig.speculative`, engine/speculative.py) a decode step verifies drafted
tokens and may yield several. A draft model's steps are pipelined too: after a step of decodes, the next is
planned before the host knows how many drafts that step accepts. Each request then runs its newest token and
the drafts made in flight, both taken on the device, at positions the device moves on by the accepted count;
its blocks and room are planned for all drafts accepted, its progress counted when the step is read back
(`Scheduler.schedule`'s unsettled). A step that needs the previous one's results on the host (prompt chunks
before it, penalties, min_tokens still to reach) waits for them. ngram drafts and rejection sampling read
tokens on the host: with them the engine schedules synchronously.

A request with n > 1 (or best_of) runs one sequence per sample (`SamplingParams.fan_out`), all under its
request id; the samples after the first wait until the first one's prompt is in the prefix cache and
read its KV from there. See `RequestGroup` for what is reported about them.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import replace

from deepinfer_core.backend.extensions import LogitsProcessor, Observer, RequestEvent
from deepinfer_core.backend.resolve import ResolvedBackend
from deepinfer_core.engine.block_manager import BlockManager, exact_replay_tokens, prefix_replay_tokens
from deepinfer_core.engine.config import EngineConfig
from deepinfer_core.engine.limits import context_length, tokens_needed
from deepinfer_core.engine.logprobs import LogprobRecorder
from deepinfer_core.engine.memory import blocks_for_memory
from deepinfer_core.engine.observers import notify_request, notify_step, step_stats
from deepinfer_core.engine.pending import LaunchedStep
from deepinfer_core.engine.prompts import encode_prompt
from deepinfer_core.engine.request import Delta, Request, RequestGroup, RequestOutput, RequestStatus
from deepinfer_core.engine.runner import ModelRunner
from deepinfer_core.engine.scheduler import Scheduler
from deepinfer_core.engine.snapshots import WindowSnapshots, first_needed
from deepinfer_core.engine.speculative import SpeculativeStats, accepted_prefix, check_model
from deepinfer_core.engine.step_costs import scheduler_options
from deepinfer_core.engine.stops import held_back, stop_after
from deepinfer_core.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from deepinfer_core.errors import RequestError
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.structured import GrammarCompiler, StructuredOutputStats

__all__ = ["Engine", "EngineConfig", "RequestError"]  # EngineConfig: engine/config.py

log = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        model,
        backend: ResolvedBackend,
        tokenizer: Tokenizer | None,
        config: EngineConfig = EngineConfig(),
        logits_processors: Sequence[LogitsProcessor] = (),
        observers: Sequence[Observer] = (),
        drafter=None,
    ) -> None:
        """drafter: the draft model of `config.speculative` when its method has one (mtp: model/mtp.py)."""
        self.model, self.backend, self.tokenizer, self.config = model, backend, tokenizer, config
        spec = config.speculative
        if spec is not None:
            check_model(model, spec, drafter)
        self._logprobs = LogprobRecorder(tokenizer)
        self.max_model_len = context_length(config.max_model_len, model.config.max_position_embeddings)
        block_size = backend.kv_layout.block_size
        num_blocks = config.num_kv_blocks or blocks_for_memory(
            model.cache_specs + (drafter.cache_specs if drafter is not None else []),
            backend.kv_layout,
            config.kv_cache_memory_bytes,
            num_seqs=config.scheduler.max_num_seqs,
            max_model_len=self.max_model_len,
        )
        self.runner = ModelRunner(
            model,
            backend,
            num_blocks,
            logits_processors,
            graph_batch_size=min(config.graph_batch_size, config.scheduler.max_num_seqs),
            max_model_len=self.max_model_len,
            num_seq_slots=config.scheduler.max_num_seqs,
            drafter=drafter,
            num_draft_tokens=spec.num_speculative_tokens if spec else 0,
            rejection=spec is not None and spec.acceptance == "rejection",
        )
        snapshots = WindowSnapshots(  # none while speculating: a step's snapshot would hold its drafts' writes
            backend.kv_layout,
            model.cache_specs,
            self.runner.caches,
            backend.torch_device,
            config.window_snapshot_bytes if config.enable_prefix_caching and spec is None else 0,
            block_size,
        )
        self.blocks = BlockManager(
            num_blocks,
            block_size,
            config.enable_prefix_caching,
            num_seq_slots=config.scheduler.max_num_seqs,
            replay_tokens=prefix_replay_tokens(config.prefix_replay, exact_replay_tokens(model, drafter)),
            snapshots=snapshots,
        )
        self.snapshots = self.blocks.snapshots  # None: the model has no per-sequence caches, or no budget
        snapshots.log_start(self.blocks.replay_tokens if config.enable_prefix_caching else None)
        self.runner.snapshot_boundaries = self.snapshots is not None
        speculation = {}  # the scheduler's drafting: proposer, adaptive verification's estimates and step costs
        if spec is not None:
            speculation = scheduler_options(spec, self.runner, backend.step_timer, self.blocks, config.scheduler)
        self.scheduler = Scheduler(config.scheduler, self.blocks, backend.cost_model, **speculation)
        self.spec_stats = SpeculativeStats() if spec else None
        self.observers = list(observers)
        eos = set(model.config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self._grammars: GrammarCompiler | None = None  # structured outputs' compiler, made at the first such request
        self._requests: dict[str, RequestGroup] = {}  # unfinished requests, by id
        self._detokenizers: dict[Request, IncrementalDetokenizer] = {}
        self._seeds = random.Random(config.seed)  # None: seeded from the system's randomness
        self._arrivals = itertools.count()
        self._step = 0
        self._in_flight: LaunchedStep | None = None
        wanted = config.async_scheduling
        self.async_scheduling = backend.capabilities.async_scheduling if wanted is None else wanted
        if self.async_scheduling and self.runner.logits_processors:  # they read output tokens on the host
            log.info("logits processors are loaded: the engine schedules synchronously")
            self.async_scheduling = False
        if self.async_scheduling and spec is not None and (spec.method == "ngram" or spec.acceptance == "rejection"):
            # ngram drafts from the sequence's tokens on the host, rejection sampling reads the drafts there
            log.info("speculative %s, %s acceptance: the engine schedules synchronously", spec.method, spec.acceptance)
            self.async_scheduling = False

    # ---- requests -------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams) -> None:
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        token_ids = encode_prompt(prompt, self.tokenizer, self.model.config.vocab_size)
        capacity = self.blocks.num_blocks * self.blocks.block_size
        needed = tokens_needed(len(token_ids), params.max_tokens, self.max_model_len, capacity)
        if params.structured_outputs is not None:  # compiled (or found cached) before admission
            self.structured_compiler().grammar(params.structured_outputs)
        samples = self._samples(request_id, text, token_ids, params, needed)
        group = RequestGroup(request_id, text, params, samples)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(token_ids)
        self._requests[request_id] = group
        if self.config.enable_prefix_caching:
            group.held = samples[1:]
            self.scheduler.add(samples[0])
        else:  # nothing to share: every sample computes the prompt
            for sample in samples:
                self.scheduler.add(sample)
        notify_request(self.observers, RequestEvent(request_id, "arrived"))

    @property
    def structured_stats(self) -> StructuredOutputStats | None:
        """Compile and mask timings of structured outputs (None until a request asked for them)."""
        return self._grammars.stats if self._grammars is not None else None

    def structured_compiler(self) -> GrammarCompiler:
        """Structured outputs' grammar compiler for this engine's tokenizer (made at the first call); a
        RequestError where structured outputs cannot run."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise RequestError("structured outputs need the model's tokenizer; this engine was started without one")
            vocab = self.model.config.vocab_size
            self._grammars = GrammarCompiler(self.tokenizer.to_json(), vocab, self.eos_token_ids)
            self.runner.structured_stats = self._grammars.stats
        return self._grammars

    def _samples(
        self, request_id: str, text: str | None, token_ids: list[int], params: SamplingParams, max_num_tokens: int
    ) -> list[Request]:
        """One sequence per sample of the request, with its seed (drawn when the request has none)."""
        arrival, vocab = next(self._arrivals), self.model.config.vocab_size
        masked = tuple(t for t in sorted(self.eos_token_ids | set(params.stop_token_ids)) if 0 <= t < vocab)
        samples = []
        for index, sample_params in enumerate(params.fan_out()):
            if index:  # the first sample computes the prompt's logprobs; the others read its KV from the cache
                sample_params = replace(sample_params, prompt_logprobs=None)
            seed = sample_params.seed if sample_params.seed is not None else self._seeds.getrandbits(64)
            sample = Request(request_id, text, token_ids, sample_params, seed, arrival, index=index)
            sample.max_num_tokens = max_num_tokens
            sample.min_tokens_masked = masked if params.min_tokens else ()
            if params.structured_outputs is not None:  # each sample walks the grammar on its own
                sample.grammar = self._grammars.state(params.structured_outputs)
            if self.tokenizer is not None:
                self._detokenizers[sample] = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
            samples.append(sample)
        return samples

    def abort(self, request_id: str) -> None:
        """End a request and all its samples; an unknown or finished request id is ignored."""
        group = self._requests.pop(request_id, None)
        if group is None:
            return
        for sample in group.samples:
            if not sample.finished:
                sample.finish_reason = "abort"
                self.scheduler.finish(sample)
            self._detokenizers.pop(sample, None)
        notify_request(self.observers, RequestEvent(request_id, "aborted"))

    def has_unfinished(self) -> bool:
        """True while a request waits or runs, or a step's outputs are still to be reported."""
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ---- steps ----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; report every request that got a token (or finished). With asynchronous
        scheduling the tokens reported are those of the step issued by the previous call."""
        started = time.perf_counter()
        if not self.async_scheduling:
            launched = self._launch()
            outputs = self._finalize(launched) if launched else []
        else:
            outputs = []
            if self._in_flight is not None and not self._pipelines(self._in_flight):
                outputs, self._in_flight = self._finalize(self._in_flight), None  # the next step needs its results
            launched = self._launch()
            previous, self._in_flight = self._in_flight, launched
            if previous is not None:  # while the launched step's structured-output masks fill, if it has any
                outputs = self._finalize(previous)
            if launched is not None:
                try:
                    launched.issue()
                except BaseException:
                    self._in_flight = None  # its sampling failed: the next step must not take its tokens
                    raise
        self.scheduler.record_step_time(time.perf_counter() - started)  # adaptive verification learns from it
        return outputs

    def _pipelines(self, step: LaunchedStep) -> bool:
        """Whether the next step may be planned while `step` runs. Without drafts, always: the next step finds each
        request's newest token on the device (a structured-output request's next mask waits for its token on the
        host: the runner calls `step.advance_grammars` between the next step's model and its sampling). Speculating,
        where `step` lets it (LaunchedStep.pipelines_drafts) and samples no structured-output request (its verify
        rows' masks follow the drafts on the host)."""
        if self.spec_stats is None:
            return True
        return step.pipelines_drafts() and all(request.grammar is None for request in step.sampled)

    def _launch(self) -> LaunchedStep | None:
        """Plan a step and issue its model and sampler work; its tokens stay on the device."""
        unsettled = None  # speculating, pipelined: the requests whose newest token and drafts are in flight
        if self._in_flight is not None and self.spec_stats is not None:
            unsettled = self._in_flight.verified()
        scheduled = self.scheduler.schedule(unsettled)
        if not scheduled.requests:
            return None
        if self.spec_stats is not None:
            self.spec_stats.num_proposed_tokens += scheduled.num_proposed_tokens
        in_flight = self._in_flight.tokens() if self._in_flight else None
        needed = None  # as the runner computes it for the step: a snapshot is whole from there on
        if self.snapshots is not None:
            needed = [first_needed(r, self.blocks.block_size, True) for r, _ in scheduled.requests]
        grammars = self._in_flight.grammar_feed() if self._in_flight else None  # while this step's model runs
        launched = LaunchedStep(scheduled, self.runner.launch(scheduled.requests, in_flight, grammars))
        for row, (request, count) in enumerate(scheduled.requests):
            request.num_computed_tokens += count - len(request.draft_token_ids)  # drafts: once accepted
            self.blocks.cache_full_blocks(request)  # blocks whose tokens are all known on the host
            if needed is not None:
                self.snapshots.after_step(request, needed[row])
            if request.num_computed_tokens >= len(request.prompt_token_ids):
                self._release_samples(request)
        for request in dict.fromkeys(launched.sampled):  # a verify step samples a request on several rows
            request.num_pending_tokens += 1  # known when this step is finalized (with any accepted drafts)
        for chunk in launched.prompt_logprobs:
            chunk.request.num_prompt_logprobs = chunk.first + chunk.logprobs.logprobs.shape[0] - 1
        return launched

    def _release_samples(self, request: Request) -> None:
        """The request's prompt is computed and its full blocks cached: its held samples may run now."""
        group = self._requests.get(request.request_id)
        if group is not None and group.held and request is group.samples[0]:
            self.scheduler.add_first(group.held)
            group.held = []

    def _finalize(self, step: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's results back; append the tokens, detokenize, check stops, report."""
        results = step.read()
        for chunk in results.prompt_logprobs:
            group = self._requests.get(chunk.request.request_id)
            if group is not None and not chunk.request.finished and group.prompt_logprobs is not None:
                self._logprobs.record_prompt(group, chunk)
        changed: dict[RequestGroup, dict[int, Delta]] = {}
        if results.drafts is not None:  # a draft model's drafts for each sampled request's next step
            confidence = results.draft_confidence or [[]] * len(results.drafts)
            after = self._in_flight if self._in_flight is not step else None  # that step, if already issued
            for request, drafts, sure in zip(dict.fromkeys(step.sampled), results.drafts, confidence):
                request.next_draft_token_ids, request.next_draft_confidence = drafts, sure
                if after is not None and request in after.drafts:  # it verifies them (it took them on the device)
                    after.drafts[request] = drafts[: len(after.drafts[request])]
        row = 0
        while row < len(step.sampled):
            request = step.sampled[row]
            drafts = step.drafts.get(request, ())
            rows = range(row, row + len(drafts) + 1)  # its own token's row, then one per draft
            row = rows.stop
            request.num_pending_tokens -= 1
            if request.finished:  # stopped or aborted after this step was issued: drop the token
                continue
            accepted = accepted_prefix(drafts, [results.token_ids[r] for r in rows])
            if drafts:
                self.spec_stats.record(len(drafts), accepted, self.config.speculative.num_speculative_tokens)
                if self.scheduler.acceptance is not None:
                    self.scheduler.acceptance.record(len(drafts), accepted)
            new_text, new_tokens = "", []
            for r in rows[: accepted + 1]:  # the accepted drafts are the tokens sampled at their positions
                new_tokens.append(results.token_ids[r])
                new_text += self._append_token(request, results, r, step.grammar_accepted.get(request))
                if request.finished:
                    break
            request.draft_token_ids = []
            if request.finished:
                self._detokenizers.pop(request, None)
            elif request.status is RequestStatus.RUNNING:  # the accepted drafts' KV is computed (unless preempted
                # while this step ran: it computes all again); the block a token completes may be too
                request.num_computed_tokens += len(new_tokens) - 1
                self.blocks.cache_full_blocks(request)
                if self.snapshots is not None:
                    self.snapshots.keep_pending(request)
            changed.setdefault(self._requests[request.request_id], {})[request.index] = (new_text, tuple(new_tokens))
        outputs = []
        for group, deltas in changed.items():
            if group.finished:
                self._requests.pop(group.request_id, None)
                notify_request(
                    self.observers, RequestEvent(group.request_id, "finished", group.samples[0].finish_reason or "")
                )
            if (report := group.report(deltas)) is not None:
                outputs.append(report)
        self._step += 1
        if self.observers:
            notify_step(self.observers, step_stats(self._step, step, self.scheduler, self.blocks))
        return outputs

    def _append_token(self, request: Request, results, row: int, grammar_accepted: bool | None = None) -> str:
        """Append sampled row `row`'s token (and its logprobs) to the request; its text to report.
        `grammar_accepted`: the outcome where its grammar already took the token (LaunchedStep.advance_grammars)."""
        token = results.token_ids[row]
        request.output_token_ids.append(token)
        if grammar_accepted is None and request.grammar is not None:
            grammar_accepted = request.grammar.accept(token)
        if grammar_accepted is False:  # only if its mask allowed nothing
            log.warning("request %s: its grammar refused token %d (%s); ending it", request.request_id, token,
                        request.grammar.error)  # fmt: skip
            request.finish_reason = "abort"
            self.scheduler.finish(request)
            return ""
        request.cumulative_logprob += results.logprobs[row]  # always: best_of ranks samples by it
        if (wanted := request.params.logprobs) is not None:
            rank = results.ranks[row] if results.ranks is not None else None
            top = (results.top_ids[row][:wanted], results.top_logprobs[row][:wanted])
            self._logprobs.record(request, token, results.logprobs[row], rank, *top)
        return self._append_token_text(request, token)

    def _append_token_text(self, request: Request, token: int) -> str:
        """Check the stop conditions and detokenize the new token; returns the text to report for it. As
        vLLM's: the text of a stop token (EOS, stop_token_ids) stays out, and a stop string cuts the text
        (neither it nor what follows is ever reported)."""
        reason, stop = stop_after(request, token, self.eos_token_ids, self._detokenize)
        if reason is not None:
            request.finish_reason, request.stop_reason = reason, stop
            self.scheduler.finish(request)
        # never report text that a later token may still turn into a stop string (it is cut then)
        text = request.text
        end = len(text) if request.finished else len(text) - held_back(text, request.params.stop)
        delta, request.num_reported_chars = request.text[request.num_reported_chars : end], end
        return delta

    def _detokenize(self, request: Request) -> str:
        detokenizer = self._detokenizers.get(request)
        if detokenizer is None:
            return ""
        delta = detokenizer.update(request.output_token_ids)
        request.text = detokenizer.text
        return delta
