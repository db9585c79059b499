"""Timings of structured outputs, kept by the engine and read (drained) when metrics are scraped."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

__all__ = ["StructuredOutputStats"]

_KEPT = 4096  # samples held between two scrapes at most (older ones are dropped, not the process's memory)


@dataclass
class StructuredOutputStats:
    """compile_seconds: one sample per grammar compiled (a cache miss); mask_seconds: one per constrained row of a
    step, the host time to fill its token mask."""

    compile_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=_KEPT))
    mask_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=_KEPT))

    def drain(self) -> tuple[list[float], list[float]]:
        """(compile samples, mask samples) since the last drain."""
        compiled, masks = list(self.compile_seconds), list(self.mask_seconds)
        self.compile_seconds.clear()
        self.mask_seconds.clear()
        return compiled, masks
