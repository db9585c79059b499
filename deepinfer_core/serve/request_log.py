"""One INFO line per finished HTTP request (logger `deepinfer.serve.requests`; --log-level silences it):
its engine request id, route, HTTP status, prompt and generated tokens, finish reasons and latency.

The route handler opens a record (`open_record`) for the duration of the request; the async engine,
which every route goes through, adds the engine's side (`current()`): so every route is covered
without each protocol threading the record through. The record travels in a context variable because
a streamed response is produced after the handler returned, in tasks that inherit the context.
"""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field

__all__ = ["RequestRecord", "current", "log_finished", "open_record"]

log = logging.getLogger("deepinfer.serve.requests")
_current: ContextVar[RequestRecord | None] = ContextVar("deepinfer_request_record", default=None)


@dataclass
class RequestRecord:
    route: str
    http_request_id: str | None = None  # the x-request-id header it was answered with
    started: float = field(default_factory=time.monotonic)
    request_ids: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    logged: bool = False


def open_record(route: str, http_request_id: str | None = None) -> RequestRecord:
    """A new record for the request being handled in this context (and the tasks it starts)."""
    record = RequestRecord(route, http_request_id)
    _current.set(record)
    return record


def current() -> RequestRecord | None:
    return _current.get()


def log_finished(record: RequestRecord, status: int) -> None:
    """Log the request's line, once."""
    if record.logged:
        return
    record.logged = True
    ids = record.request_ids
    request_id = "-" if not ids else ids[0] if len(ids) == 1 else f"{ids[0]} (+{len(ids) - 1} more)"
    log.info(
        "Finished request %s: route=%s x_request_id=%s status=%d prompt_tokens=%d generation_tokens=%d "
        "finish_reason=%s latency=%.3fs",
        request_id,
        record.route,
        record.http_request_id or "-",
        status,
        record.prompt_tokens,
        record.generation_tokens,
        ",".join(record.finish_reasons) or "-",
        time.monotonic() - record.started,
    )
