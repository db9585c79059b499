"""Chunk sizing from a backend's step cost model (`CostModel` is the contract's: deepinfer_core.backend)."""

from __future__ import annotations

from deepinfer_core.backend import CostModel, LinearCostModel  # the contract's; re-exported here

__all__ = ["CostModel", "LinearCostModel", "largest_chunk", "MAX_PREFILL_CHUNK"]

MAX_PREFILL_CHUNK = 32_768  # the production system caps one prefill chunk at 32,768 tokens


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
