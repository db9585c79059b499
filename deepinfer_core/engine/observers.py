"""Calling the engine's observers (backend.extensions.Observer): an observer that raises is logged and skipped,
never taking the engine down."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from deepinfer_core.backend.extensions import Observer, RequestEvent, StepStats

__all__ = ["notify_request", "notify_step", "step_stats"]

log = logging.getLogger(__name__)


def notify_request(observers: Sequence[Observer], event: RequestEvent) -> None:
    for observer in observers:
        try:
            observer.on_request(event)
        except Exception:  # an observer must never take the engine down
            log.exception("observer %r failed on %s", observer, event.kind)


def notify_step(observers: Sequence[Observer], stats: StepStats) -> None:
    for observer in observers:
        try:
            observer.on_step(stats)
        except Exception:
            log.exception("observer %r failed on a step", observer)


def step_stats(index: int, step, scheduler, blocks) -> StepStats:
    """What observers learn of the engine's step `index` (a LaunchedStep, finalized): its prefill and decode
    tokens, the requests running and waiting, the KV blocks in use."""
    decode = step.num_decode_tokens
    return StepStats(index, step.scheduled.num_tokens - decode, decode, len(scheduler.running), len(scheduler.waiting),
                     blocks.num_used_blocks, blocks.num_blocks)  # fmt: skip
