"""A rank's requests that wait for their structured-output grammar: compiled on a worker thread, then admitted.

The ranks step in lockstep, so a grammar compiled on one rank's loop (milliseconds for a schema) would hold every
rank. The front compiled it already to check it; each rank compiles it again for its own engine, here, beside its
loop. Not every part of a compile lets the loop run: llguidance holds the interpreter lock while it reads the
tokenizer (about 1-2 s, once, at a rank's first structured request) and for parts of a large schema's compile.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from deepinfer_core.errors import DeepInferError

__all__ = ["GrammarAdmission"]


class GrammarAdmission:
    """Requests held until their grammar is compiled on the engine's compiler (one worker thread)."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self._worker: ThreadPoolExecutor | None = None
        self._waiting: dict[str, tuple[Future, tuple]] = {}  # request id -> (its compile, its "add" message)

    def needs(self, params) -> bool:
        return params.structured_outputs is not None

    def hold(self, request_id: str, prompt, params) -> None:
        """Compile the request's grammar on the worker thread; `admit` adds it once that is done."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-rank-grammars")
        engine, wanted = self._engine, params.structured_outputs
        compiled = self._worker.submit(lambda: engine.structured_compiler().grammar(wanted))
        self._waiting[request_id] = (compiled, (request_id, prompt, params))

    def abort(self, request_id: str) -> bool:
        """Forget a held request (its compile is dropped if it has not started); False when none is held by that id."""
        held = self._waiting.pop(request_id, None)
        if held is not None:
            held[0].cancel()
        return held is not None

    def admit(self) -> list[tuple[str, str]]:
        """Add every held request whose grammar is compiled to the engine; (request id, why) of each refused (its
        grammar or its request a DeepInferError)."""
        refused = []
        for request_id, (compiled, request) in list(self._waiting.items()):
            if not compiled.done():
                continue
            del self._waiting[request_id]
            try:
                compiled.result()
                self._engine.add_request(*request)  # finds the grammar cached
            except DeepInferError as err:
                refused.append((request_id, str(err)))
        return refused

    def __len__(self) -> int:
        return len(self._waiting)
