"""One asynchronous engine loop shared by every connection: requests from all HTTP handlers are
batched together, each handler reads its own request's outputs from a queue.

The engine is not thread-safe and its steps run in a worker thread (so the event loop keeps serving),
so handlers never touch it directly: additions and aborts are queued and applied between steps.

Every request of every route passes here, so this is where per-request metrics (vLLM's time to first
token, inter-token latency, end-to-end latency, token counts, finish reasons) and the request log's
engine side are recorded: timed when the engine reports, not when a slow client reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from deepinfer_core.engine.engine import Engine
from deepinfer_core.engine.request import FailedRequest, RequestOutput
from deepinfer_core.errors import DeepInferError
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.serve import request_log
from deepinfer_core.serve.metrics import ServerMetrics
from deepinfer_core.structured import StructuredOutputError, StructuredOutputsParams

__all__ = ["AsyncEngine", "EngineFailure", "Overloaded", "ShuttingDown"]

log = logging.getLogger(__name__)


GRAMMAR_TIMEOUT_S = 30.0  # the longest a request's structured-output grammar may take to compile


class Overloaded(DeepInferError):
    """Too many requests are waiting; the client should retry later."""


class EngineFailure(DeepInferError):
    """A step failed (a bug, not bad input); the request cannot complete."""


class ShuttingDown(DeepInferError):
    """The server is stopping and its grace period for in-flight requests ran out."""


@dataclass
class _Add:
    request_id: str
    prompt: Sequence[int]
    params: SamplingParams
    accepted: asyncio.Future


@dataclass
class _Flight:
    """A request between its arrival and its last report: where its outputs go, and its timings."""

    queue: asyncio.Queue
    num_prompt_tokens: int
    params: SamplingParams
    record: request_log.RequestRecord | None
    arrival: float = field(default_factory=time.monotonic)
    last: float | None = None  # when it last reported
    ttft: float | None = None
    num_generated: int = 0  # tokens of the reported samples (best_of's discarded ones are never reported)
    finished: bool = False  # its finish (or abort) is recorded

    def report(self, output: RequestOutput, now: float, metrics: ServerMetrics | None) -> None:
        new_tokens = sum(len(c.new_token_ids) for c in output.outputs)
        first = self.last is None
        if first:
            self.ttft = now - self.arrival
        if metrics is not None:
            interval = now - (self.arrival if first else self.last)
            metrics.request_output(interval, new_tokens, self.num_prompt_tokens if first else None)
        self.last, self.num_generated = now, self.num_generated + new_tokens
        if self.record is not None:
            self.record.prompt_tokens += self.num_prompt_tokens if first else 0
            self.record.generation_tokens += new_tokens
        if output.finished:
            self.finish(output.outputs[0].finish_reason or "stop", now, metrics)

    def finish(self, reason: str, now: float, metrics: ServerMetrics | None) -> None:
        if self.finished:
            return
        self.finished = True
        if self.record is not None:
            self.record.finish_reasons.append(reason)
        if metrics is not None:
            p = self.params
            metrics.request_finished(
                reason, self.num_prompt_tokens, self.num_generated, now - self.arrival, self.ttft, p.max_tokens, p.n
            )


class AsyncEngine:
    def __init__(self, engine: Engine, max_waiting: int = 512, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.grammar_timeout_s = GRAMMAR_TIMEOUT_S
        self.metrics = metrics  # set by build_app when not given here
        self._adds: list[_Add] = []
        self._aborts: list[str] = []
        self._flights: dict[str, _Flight] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._ended: str | None = None  # why every request was ended (shutdown), once it was
        self.num_in_flight = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="deepinfer-engine-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def generate(
        self, request_id: str, prompt: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come; leaving early (disconnect, error) aborts the request."""
        # counted in sequences: a request with n (or best_of) samples runs that many
        if self._ended is not None:
            raise ShuttingDown(self._ended)
        samples, limit = params.num_samples, self.max_waiting + self.engine.scheduler.config.max_num_seqs
        if self.num_in_flight and self.num_in_flight + samples > limit:
            raise Overloaded(f"{self.num_in_flight} sequences are in flight; retry shortly")
        queue: asyncio.Queue = asyncio.Queue()
        accepted = asyncio.get_running_loop().create_future()
        record = request_log.current()
        if record is not None:
            record.request_ids.append(request_id)
        flight = _Flight(queue, len(prompt), params, record)
        self._flights[request_id] = flight
        self._adds.append(_Add(request_id, prompt, params, accepted))
        self._wakeup.set()
        self.num_in_flight += samples
        finished = admitted = False
        try:
            await accepted  # raises the engine's RequestError for a request it refuses
            admitted = True
            while True:
                output = await queue.get()
                if isinstance(output, Exception):
                    raise output
                yield output
                if output.finished:
                    finished = True
                    return
        finally:
            self.num_in_flight -= samples
            self._flights.pop(request_id, None)
            if not finished:
                self._aborts.append(request_id)
                self._wakeup.set()
                if admitted:
                    flight.finish("abort", time.monotonic(), self.metrics)

    async def compile_structured(self, wanted: StructuredOutputsParams) -> None:
        """Compile a request's structured-output grammar in a worker thread (the engine loop and other requests
        go on), at most GRAMMAR_TIMEOUT_S: the request's admission then finds it cached. Raises the compiler's
        StructuredOutputError, or one saying it took too long."""
        compiler = await asyncio.to_thread(self.engine.structured_compiler)
        try:
            await asyncio.wait_for(asyncio.to_thread(compiler.grammar, wanted), self.grammar_timeout_s)
        except TimeoutError:
            raise StructuredOutputError(
                f"the structured-output constraint did not compile within {self.grammar_timeout_s:g} s; "
                "simplify the schema or grammar"
            ) from None

    def end_all(self, reason: str) -> None:
        """End every request now, and refuse new ones: each handler's next read raises ShuttingDown(reason)
        (a stream then ends with its protocol's error event); the engine aborts them between steps."""
        self._ended = reason
        for add in self._adds:
            if not add.accepted.done():
                add.accepted.set_exception(ShuttingDown(reason))
        for flight in self._flights.values():
            flight.queue.put_nowait(ShuttingDown(reason))
        self._wakeup.set()

    @property
    def alive(self) -> bool:
        """False once the engine loop has stopped (then no request can be served: /health says so)."""
        return self._task is not None and not self._task.done()

    def _apply_pending(self) -> None:
        adds, self._adds = self._adds, []
        for add in adds:
            if add.accepted.done():  # its handler left before admission (cancelled): never add it
                continue
            try:
                self.engine.add_request(add.request_id, add.prompt, add.params)
            except DeepInferError as err:
                add.accepted.set_exception(err)
            except Exception:  # a bug of ours: fail this request, keep the loop (and every other request)
                log.exception("adding request %s failed", add.request_id)
                add.accepted.set_exception(EngineFailure("the engine could not take this request"))
            else:
                add.accepted.set_result(None)
        aborts, self._aborts = self._aborts, []
        for request_id in aborts:
            self.engine.abort(request_id)

    async def _loop(self) -> None:
        while True:
            self._apply_pending()
            if not self.engine.has_unfinished():
                self._wakeup.clear()
                if not (self._adds or self._aborts):
                    await self._wakeup.wait()
                continue
            try:
                outputs = await asyncio.to_thread(self.engine.step)
            except Exception:  # a failing step must not kill the server; fail the requests in it
                log.exception("engine step failed; failing its requests")
                for request in list(self.engine.scheduler.running):
                    self.engine.abort(request.request_id)
                    if (flight := self._flights.get(request.request_id)) is not None:
                        flight.queue.put_nowait(EngineFailure("the engine failed while running this request"))
                continue
            now = time.monotonic()
            for output in outputs:
                if (flight := self._flights.get(output.request_id)) is None:
                    continue
                if isinstance(output, FailedRequest):  # this request alone ends, with its reason
                    flight.queue.put_nowait(output.error)
                    continue
                flight.report(output, now, self.metrics)
                flight.queue.put_nowait(output)
