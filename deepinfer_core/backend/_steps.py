"""What a backend returns about whole engine steps: what a step costs (`CostModel`, core's default
`LinearCostModel`), how long one takes on the device (`StepTimer`, core's default `WallClockStepTimer`; the
engine keeps what it measured as a `StepCostTable`) and how a decode step is captured as a device graph
(`GraphCapture`).

Part of the contract: imports only torch, no engine module (the engine imports these from here).
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter
from typing import Protocol, runtime_checkable

import torch

__all__ = ["CostModel", "GraphCapture", "LinearCostModel", "StepCostTable", "StepTimer", "WallClockStepTimer"]


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


@dataclass(frozen=True, slots=True)
class StepCostTable:
    """Measured seconds of a decode / verify step by the number of tokens in it (engine/step_costs.py profiles
    one at start-up for adaptive verification).

    `cost(tokens)` is piecewise linear between the measured token counts, flat below the first and linear past
    the last (along the last segment). Measurements are noisy, so `seconds` is kept as their running maximum:
    a step never costs less for having more tokens, which the planner relies on."""

    tokens: tuple[int, ...]  # strictly increasing token counts, 1 or more
    seconds: tuple[float, ...]  # the step's seconds at each

    def __post_init__(self) -> None:
        tokens, seconds = tuple(self.tokens), tuple(float(s) for s in self.seconds)
        if not tokens or len(tokens) != len(seconds):
            raise ValueError(
                f"a StepCostTable needs one time per token count and at least one of each; got {len(tokens)} "
                f"token counts and {len(seconds)} times"
            )
        counts_ok = all(isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in tokens)
        if not counts_ok or any(a >= b for a, b in itertools.pairwise(tokens)):
            raise ValueError(
                f"a StepCostTable's token counts must be strictly increasing integers of 1 or more, got {list(tokens)}"
            )
        if not all(math.isfinite(s) and s >= 0 for s in seconds):
            raise ValueError(f"a StepCostTable's times must be finite seconds of 0 or more, got {list(seconds)}")
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "seconds", tuple(itertools.accumulate(seconds, max)))

    def cost(self, tokens: int) -> float:
        """Estimated seconds of a step with `tokens` tokens."""
        xs, ys = self.tokens, self.seconds
        if tokens <= xs[0]:
            return ys[0]
        if len(xs) == 1:  # one measurement: proportional past it
            return ys[0] * tokens / xs[0]
        i = min(bisect.bisect_left(xs, tokens), len(xs) - 1)  # the segment (xs[i - 1], xs[i]] holds tokens
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (tokens - xs[i - 1]) / (xs[i] - xs[i - 1])

    def to_json(self) -> str:
        return json.dumps({"tokens": list(self.tokens), "seconds": list(self.seconds)})

    def __repr__(self) -> str:
        steps = ", ".join(f"{t}: {s * 1e3:.3g} ms" for t, s in zip(self.tokens, self.seconds))
        return f"StepCostTable({steps})"


@runtime_checkable
class StepTimer(Protocol):
    """A backend's step timer (hook `deepinfer_backend_step_timer`): what one engine step takes on the device."""

    def time(self, step: Callable[[], torch.Tensor], runs: int = 2) -> float:
        """Run `step` once to warm up, then `runs` more times; the median seconds of those runs, each measured
        until the device has finished it.

        `step` issues one whole step on the device and returns a tensor of its results (reading it on the host
        waits for the step)."""
        ...


@dataclass(frozen=True, slots=True)
class WallClockStepTimer:
    """Core's default step timer: host wall-clock time until the step's result has been read to the host."""

    def time(self, step: Callable[[], torch.Tensor], runs: int = 2) -> float:
        if runs < 1:
            raise ValueError(f"a step is timed over 1 or more runs, got runs={runs}")
        step().cpu()  # warm-up; reading the result also waits for anything queued before the first timed run
        times = []
        for _ in range(runs):
            start = perf_counter()
            step().cpu()  # the copy to the host waits until the device has finished the step
            times.append(perf_counter() - start)
        return statistics.median(times)
