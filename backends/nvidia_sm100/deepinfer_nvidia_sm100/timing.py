"""Step timing with CUDA events (hook `deepinfer_backend_step_timer`): the device's own clock, not the host's.

Imports torch only; touches CUDA only when a step is timed.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

__all__ = ["CudaEventStepTimer"]


class CudaEventStepTimer:
    """Core's WallClockStepTimer's contract, timed between events recorded on the device's current stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def time(self, step: Callable[[], torch.Tensor], runs: int = 2) -> float:
        if runs < 1:
            raise ValueError(f"a step is timed over 1 or more runs, got runs={runs}")
        step()  # warm-up: lazy initialisation, kernel compilation
        stream = torch.cuda.current_stream(self.device)
        times = []
        for _ in range(runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            step()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)  # milliseconds -> seconds
        return statistics.median(times)
