"""What a backend returns about whole engine steps: what a step costs (`CostModel`, core's default
`LinearCostModel`) and how a decode step is captured as a device graph (`GraphCapture`).

Part of the contract: imports only torch, no engine module (the engine imports these from here).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

__all__ = ["CostModel", "GraphCapture", "LinearCostModel"]


@runtime_checkable
class CostModel(Protocol):
    """A backend's step cost model (hook `deepinfer_backend_cost_model`); the scheduler sizes prefill
    chunks with it."""

    def cost(self, q_tokens: int, ctx_tokens: int) -> float:
        """Estimated seconds for a step that processes `q_tokens` new tokens of a sequence that will
        then hold `ctx_tokens` tokens (so attention reads ctx_tokens per query). Must not decrease
        as q_tokens grows."""
        ...


@dataclass(frozen=True, slots=True)
class LinearCostModel:
    """cost = fixed + per_token * q + per_attended * q * ctx: launch overhead, weights, attention.

    Core's default when a backend has no cost model; a backend may return one with its own measured
    coefficients."""

    fixed_s: float = 2e-3
    per_token_s: float = 5e-5
    per_attended_s: float = 1e-9

    def cost(self, q_tokens: int, ctx_tokens: int) -> float:
        return self.fixed_s + self.per_token_s * q_tokens + self.per_attended_s * q_tokens * ctx_tokens


@runtime_checkable
class GraphCapture(Protocol):
    """A backend's device-graph capturer (hook `deepinfer_backend_graph_capture`)."""

    def capture(self, step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Warm `step` up, capture its device work into a graph and return `replay`, which re-runs that
        work and returns the tensor `step` returned while captured (the same storage every replay).

        `step` reads only tensors that outlive the capture and must not read device values on the host.
        """
        ...
