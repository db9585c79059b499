"""Calling the engine's observers (backend.extensions.Observer): an observer that raises is logged and skipped,
never taking the engine down."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from deepinfer_core.backend.extensions import Observer, RequestEvent, StepStats

__all__ = ["notify_request", "notify_step"]

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
