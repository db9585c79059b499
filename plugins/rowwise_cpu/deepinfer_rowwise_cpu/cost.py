"""rowwise_cpu's step cost model (deepinfer_core.backend.CostModel); imports nothing but the standard library.

Every op loops over token rows in Python and attention visits every cached block once per query row, so
a step costs a fixed part plus a large per-row part plus a per-(query, attended token) part.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RowwiseCostModel"]


@dataclass(frozen=True, slots=True)
class RowwiseCostModel:
    """cost = fixed + per_row * q + per_attended * q * ctx (seconds); monotone in q and ctx."""

    fixed_s: float = 1e-3
    per_row_s: float = 2e-3  # a few hundred small kernel calls per token row
    per_attended_s: float = 2e-8  # online softmax over one cached token, all heads, one query row

    def cost(self, q_tokens: int, ctx_tokens: int) -> float:
        return self.fixed_s + self.per_row_s * q_tokens + self.per_attended_s * q_tokens * ctx_tokens
