"""The step cost model: how a backend tells the scheduler what a step costs, and chunk sizing from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["CostModel", "LinearCostModel", "largest_chunk", "MAX_PREFILL_CHUNK"]

MAX_PREFILL_CHUNK = 32_768  # the production system caps one prefill chunk at 32,768 tokens


@runtime_checkable
class CostModel(Protocol):
    def cost(self, q_tokens: int, ctx_tokens: int) -> float:
        """Estimated seconds for a step that processes `q_tokens` new tokens of a sequence that will
        then hold `ctx_tokens` tokens (so attention reads ctx_tokens per query). Must not decrease
        as q_tokens grows."""
        ...


@dataclass(frozen=True, slots=True)
class LinearCostModel:
    """cost = fixed + per_token * q + per_attended * q * ctx: launch overhead, weights, attention."""

    fixed_s: float = 2e-3
    per_token_s: float = 5e-5
    per_attended_s: float = 1e-9

    def cost(self, q_tokens: int, ctx_tokens: int) -> float:
        return self.fixed_s + self.per_token_s * q_tokens + self.per_attended_s * q_tokens * ctx_tokens


def largest_chunk(
    model: CostModel, cached_tokens: int, remaining: int, budget_s: float, cap: int = MAX_PREFILL_CHUNK
) -> int:
    """The most prompt tokens (at least 1, at most min(remaining, cap)) whose step fits in budget_s,
    for a sequence that already has `cached_tokens` in its cache."""
    lo, hi = 1, max(1, min(remaining, cap))
    while lo < hi:  # largest q with cost(q, cached + q) <= budget
        mid = (lo + hi + 1) // 2
        if model.cost(mid, cached_tokens + mid) <= budget_s:
            lo = mid
        else:
            hi = mid - 1
    return lo
