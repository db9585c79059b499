"""CUDA graph capture for the engine's decode steps (hook `deepinfer_backend_graph_capture`)."""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch

__all__ = ["CudaGraphCapture"]


class CudaGraphCapture:
    """Captures with torch.cuda.graph; all graphs of one engine share one memory pool."""

    WARMUP_RUNS = 2  # lazy initialisation (cuBLAS workspaces, Triton compilation) happens before capture

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: torch.cuda.Stream | None = None
        self._pool = None

    def capture(self, step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
            self._pool = torch.cuda.graph_pool_handle()
        stream = self._stream  # warm-up and capture on one stream: per-stream library workspaces exist by then
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(self.WARMUP_RUNS):
                step()
        stream.synchronize()
        # graphs of engines no longer referenced must not be freed by the garbage collector mid-capture
        gc.collect()
        gc.disable()
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                out = step()
        finally:
            gc.enable()
        torch.cuda.current_stream(self.device).wait_stream(stream)

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay
