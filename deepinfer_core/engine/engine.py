"""The engine: requests in, steps run, outputs out. Scheduler, blocks and runner are wired here once.

With asynchronous scheduling, `step()` issues step N (plan on the host, inputs, model, sampler; the
sampled tokens stay on the device) and only then reads back step N-1's tokens and reports them, so
the device never waits for the host between steps. Step N plans with a placeholder for each token of
step N-1 and takes its value on the device. Stops are seen one step late: a request that stopped at
step N-1 may be in step N, whose token for it is dropped. What callers see is what synchronous
scheduling gives. Penalties count the in-flight token (copied in on the device); logits processors
read output tokens on the host, so with any loaded the engine schedules synchronously.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer_core.backend.extensions import LogitsProcessor, Observer, RequestEvent, StepStats
from deepinfer_core.backend.resolve import ResolvedBackend
from deepinfer_core.engine.block_manager import BlockManager
from deepinfer_core.engine.pending import LaunchedStep
from deepinfer_core.engine.request import Logprob, Request, RequestOutput
from deepinfer_core.engine.runner import ModelRunner
from deepinfer_core.engine.scheduler import Scheduler, SchedulerConfig
from deepinfer_core.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from deepinfer_core.errors import DeepInferError
from deepinfer_core.kv.caches import block_bytes, sequence_bytes
from deepinfer_core.sampling.params import SamplingParams

__all__ = ["Engine", "EngineConfig", "RequestError"]

log = logging.getLogger(__name__)


class RequestError(DeepInferError):
    """A request the engine cannot serve as asked (too long, bad ids, no tokenizer for text)."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    num_kv_blocks: int | None = None  # None: size the cache from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 1 << 30
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    scheduler: SchedulerConfig = SchedulerConfig()
    async_scheduling: bool | None = None  # None: where the backend's capabilities say it supports it
    graph_batch_size: int = 256  # decode steps of up to this many sequences replay device graphs; 0: never


class Engine:
    def __init__(
        self,
        model,
        backend: ResolvedBackend,
        tokenizer: Tokenizer | None,
        config: EngineConfig = EngineConfig(),
        logits_processors: Sequence[LogitsProcessor] = (),
        observers: Sequence[Observer] = (),
    ) -> None:
        self.model, self.backend, self.tokenizer, self.config = model, backend, tokenizer, config
        self.max_model_len = min(config.max_model_len or 1 << 62, model.config.max_position_embeddings)
        block_size = backend.kv_layout.block_size
        num_blocks = config.num_kv_blocks or self._blocks_for_memory(config.kv_cache_memory_bytes, block_size)
        self.blocks = BlockManager(
            num_blocks,
            block_size,
            config.enable_prefix_caching,
            num_seq_slots=config.scheduler.max_num_seqs,
            replay_tokens=getattr(model, "replay_tokens", 0),
        )
        self.scheduler = Scheduler(config.scheduler, self.blocks, backend.cost_model)
        self.runner = ModelRunner(
            model,
            backend,
            num_blocks,
            logits_processors,
            graph_batch_size=min(config.graph_batch_size, config.scheduler.max_num_seqs),
            max_model_len=self.max_model_len,
            num_seq_slots=config.scheduler.max_num_seqs,
        )
        self.observers = list(observers)
        eos = set(model.config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self._requests: dict[str, Request] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._arrivals = itertools.count()
        self._step = 0
        self._in_flight: LaunchedStep | None = None
        wanted = config.async_scheduling
        self.async_scheduling = backend.capabilities.async_scheduling if wanted is None else wanted
        if self.async_scheduling and self.runner.logits_processors:  # they read output tokens on the host
            log.info("logits processors are loaded: the engine schedules synchronously")
            self.async_scheduling = False

    def _blocks_for_memory(self, memory_bytes: int, block_size: int) -> int:
        """Blocks that fit in `memory_bytes` once every sequence slot's per-sequence caches are set aside."""
        specs, seqs = self.model.cache_specs, self.config.scheduler.max_num_seqs
        per_sequence = sequence_bytes(specs) * seqs
        blocks = (memory_bytes - per_sequence) // block_bytes(specs, block_size)
        if blocks < 1:
            raise DeepInferError(
                f"the KV cache budget of {memory_bytes / 2**20:.0f} MiB does not fit the per-sequence caches of "
                f"{seqs} sequences ({per_sequence / 2**20:.0f} MiB) plus one block: raise kv_cache_memory_bytes "
                "or lower max_num_seqs"
            )
        return blocks

    # ---- requests -------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams) -> None:
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self._encode(prompt)
        limit = self.max_model_len
        if len(token_ids) >= limit:
            raise RequestError(
                f"the prompt has {len(token_ids)} tokens but the model's context is {limit} tokens "
                f"(it must leave room for at least one generated token)"
            )
        capacity = self.blocks.num_blocks * self.blocks.block_size
        needed = min(len(token_ids) + params.max_tokens, limit)  # the most tokens it may reach
        if needed > capacity:
            raise RequestError(
                f"the request may need {needed} tokens of KV cache (prompt {len(token_ids)} + "
                f"max_tokens {params.max_tokens}) but the cache holds {capacity}; lower max_tokens "
                f"or give the engine more KV memory"
            )
        seed = params.seed if params.seed is not None else random.getrandbits(64)
        request = Request(request_id, text, token_ids, params, seed, next(self._arrivals))
        request.max_num_tokens = needed
        self._requests[request_id] = request
        if self.tokenizer is not None:
            self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer)
        self.scheduler.add(request)
        self._notify(RequestEvent(request_id, "arrived"))

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(
                    "this model has no tokenizer.json, so prompts must be token ids (--prompt-token-ids)"
                )
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = [int(t) for t in prompt]
        if not token_ids:
            raise RequestError("the prompt is empty")
        vocab = self.model.config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        return token_ids

    def abort(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is None or request.finished:
            return
        request.finish_reason = "abort"
        self.scheduler.finish(request)
        self._detokenizers.pop(request_id, None)
        self._notify(RequestEvent(request_id, "aborted"))

    def has_unfinished(self) -> bool:
        """True while a request waits or runs, or a step's outputs are still to be reported."""
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ---- steps ----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; report every request that got a token (or finished). With asynchronous
        scheduling the tokens reported are those of the step issued by the previous call."""
        launched = self._launch()
        if not self.async_scheduling:
            return self._finalize(launched) if launched else []
        previous, self._in_flight = self._in_flight, launched
        return self._finalize(previous) if previous else []

    def _launch(self) -> LaunchedStep | None:
        """Plan a step and issue its model and sampler work; its tokens stay on the device."""
        scheduled = self.scheduler.schedule()
        if not scheduled.requests:
            return None
        in_flight = self._in_flight.tokens() if self._in_flight else None
        launched = LaunchedStep(scheduled, *self.runner.execute(scheduled.requests, in_flight))
        for request, count in scheduled.requests:
            request.num_computed_tokens += count
            self.blocks.cache_full_blocks(request)  # blocks whose tokens are all known on the host
        for request in launched.sampled:
            request.num_pending_tokens += 1  # known when this step is finalized
        return launched

    def _finalize(self, step: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's tokens back; append them, detokenize, check stops, report."""
        outputs = []
        token_ids, logprobs, top_ids, top_logprobs = step.read()
        for row, request in enumerate(step.sampled):
            request.num_pending_tokens -= 1
            if request.finished:  # stopped or aborted after this step was issued: drop the token
                continue
            token = token_ids[row]
            request.output_token_ids.append(token)
            if (wanted := request.params.logprobs) is not None:
                self._record_logprobs(request, token, logprobs[row], top_ids[row][:wanted], top_logprobs[row][:wanted])
            new_text = self._detokenize(request)
            streamed = len(request.text) - len(new_text)  # text reported before this token
            self._check_stop(request, token)
            new_text = request.text[streamed:]  # a stop string cuts the text: never report it, nor what follows
            if request.finished:
                self._requests.pop(request.request_id, None)
                self._detokenizers.pop(request.request_id, None)
                self._notify(RequestEvent(request.request_id, "finished", request.finish_reason or ""))
            else:  # the block this token completes, if the next step already computed it
                self.blocks.cache_full_blocks(request)
            outputs.append(RequestOutput.of(request, new_text, (token,)))
        self._step += 1
        self._observe_step(step)
        return outputs

    def _record_logprobs(
        self, request: Request, token: int, logprob: float, top_ids: list[int], top_logprobs: list[float]
    ) -> None:
        """The token's logprob and its top alternatives, flat and in vLLM's {token id: Logprob} shape."""
        request.logprobs.append(logprob)
        request.top_logprobs.append(dict(zip(top_ids, top_logprobs)))
        request.cumulative_logprob += logprob
        decode = self.tokenizer.decode if self.tokenizer is not None else (lambda ids: None)
        rank = top_ids.index(token) + 1 if token in top_ids else None
        entry = {token: Logprob(logprob, rank, decode([token]))}
        for i, (other, other_logprob) in enumerate(zip(top_ids, top_logprobs)):
            entry.setdefault(other, Logprob(other_logprob, i + 1, decode([other])))
        request.sample_logprobs.append(entry)

    def _detokenize(self, request: Request) -> str:
        detokenizer = self._detokenizers.get(request.request_id)
        if detokenizer is None:
            return ""
        delta = detokenizer.update(request.output_token_ids)
        request.text = detokenizer.text
        return delta

    def _check_stop(self, request: Request, token: int) -> None:
        params = request.params
        reason = stop = None
        if token in params.stop_token_ids:
            reason, stop = "stop", token
        elif token in self.eos_token_ids and not params.ignore_eos:
            reason = "stop"
        elif params.stop and (hit := _find_stop(request.text, params.stop)) is not None:
            request.text = request.text[: hit[0]]
            reason, stop = "stop", hit[1]
        elif request.num_known_tokens >= request.max_num_tokens:  # max_tokens, or the context, reached
            reason = "length"
        if reason is not None:
            request.finish_reason, request.stop_reason = reason, stop
            self.scheduler.finish(request)

    def _notify(self, event: RequestEvent) -> None:
        for observer in self.observers:
            try:
                observer.on_request(event)
            except Exception:  # an observer must never take the engine down
                log.exception("observer %r failed on %s", observer, event.kind)

    def _observe_step(self, step: LaunchedStep) -> None:
        if not self.observers:
            return
        stats = StepStats(
            self._step,
            step.scheduled.num_tokens - step.num_decode_tokens,
            step.num_decode_tokens,
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            self.blocks.num_used_blocks,
            self.blocks.num_blocks,
        )
        for observer in self.observers:
            try:
                observer.on_step(stats)
            except Exception:
                log.exception("observer %r failed on a step", observer)


def _find_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """The earliest stop string in text, as (index, stop string)."""
    hits = [(text.find(s), s) for s in stops if s in text]
    return min(hits) if hits else None
