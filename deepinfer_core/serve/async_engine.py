"""One asynchronous engine loop shared by every connection: requests from all HTTP handlers are
batched together, each handler reads its own request's outputs from a queue.

The engine is not thread-safe and its steps run in a worker thread (so the event loop keeps serving),
so handlers never touch it directly: additions and aborts are queued and applied between steps.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from deepinfer_core.engine.engine import Engine
from deepinfer_core.engine.request import RequestOutput
from deepinfer_core.errors import DeepInferError
from deepinfer_core.sampling.params import SamplingParams

__all__ = ["AsyncEngine", "EngineFailure", "Overloaded"]

log = logging.getLogger(__name__)


class Overloaded(DeepInferError):
    """Too many requests are waiting; the client should retry later."""


class EngineFailure(DeepInferError):
    """A step failed (a bug, not bad input); the request cannot complete."""


@dataclass
class _Add:
    request_id: str
    prompt: Sequence[int]
    params: SamplingParams
    accepted: asyncio.Future


class AsyncEngine:
    def __init__(self, engine: Engine, max_waiting: int = 512) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self._adds: list[_Add] = []
        self._aborts: list[str] = []
        self._queues: dict[str, asyncio.Queue] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
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
        if self.num_in_flight >= self.max_waiting + self.engine.scheduler.config.max_num_seqs:
            raise Overloaded(f"{self.num_in_flight} requests are in flight; retry shortly")
        queue: asyncio.Queue = asyncio.Queue()
        accepted = asyncio.get_running_loop().create_future()
        self._queues[request_id] = queue
        self._adds.append(_Add(request_id, prompt, params, accepted))
        self._wakeup.set()
        self.num_in_flight += 1
        finished = False
        try:
            await accepted  # raises the engine's RequestError for a request it refuses
            while True:
                output = await queue.get()
                if isinstance(output, Exception):
                    raise output
                yield output
                if output.finished:
                    finished = True
                    return
        finally:
            self.num_in_flight -= 1
            self._queues.pop(request_id, None)
            if not finished:
                self._aborts.append(request_id)
                self._wakeup.set()

    def _apply_pending(self) -> None:
        adds, self._adds = self._adds, []
        for add in adds:
            try:
                self.engine.add_request(add.request_id, add.prompt, add.params)
                add.accepted.set_result(None)
            except DeepInferError as err:
                add.accepted.set_exception(err)
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
                    if (queue := self._queues.get(request.request_id)) is not None:
                        queue.put_nowait(EngineFailure("the engine failed while running this request"))
                continue
            for output in outputs:
                queue = self._queues.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)
