"""CUDA graph capture for the engine's decode steps (hook `deepinfer_backend_graph_capture`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["CudaGraphCapture"]


class CudaGraphCapture:
    """Captures with torch.cuda.graph; all graphs of one engine share one memory pool."""

    WARMUP_RUNS = 2  # lazy initialisation (cuBLAS workspaces, Triton compilation) happens before capture

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool = None

    def capture(self, step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.WARMUP_RUNS):
                step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = step()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay
