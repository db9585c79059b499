"""The step cost model and chunk sizing from it."""

from __future__ import annotations

import itertools

import pytest

from deepinfer_core.engine.cost import MAX_PREFILL_CHUNK, CostModel, LinearCostModel, largest_chunk


def test_linear_cost_formula():
    m = LinearCostModel(fixed_s=0.5, per_token_s=0.25, per_attended_s=0.125)
    assert m.cost(0, 0) == 0.5
    assert m.cost(4, 10) == pytest.approx(0.5 + 0.25 * 4 + 0.125 * 4 * 10)
    d = LinearCostModel()
    assert d.cost(100, 1000) == pytest.approx(2e-3 + 5e-5 * 100 + 1e-9 * 100 * 1000)
    assert isinstance(d, CostModel)


def test_linear_cost_does_not_decrease_with_q():
    m = LinearCostModel()
    costs = [m.cost(q, 500 + q) for q in range(0, 300, 7)]
    assert costs == sorted(costs) and costs[0] < costs[-1]


def _brute_force(model, cached, remaining, budget, cap):
    best = 1
    for q in range(1, max(1, min(remaining, cap)) + 1):
        if model.cost(q, cached + q) <= budget:
            best = q
    return best


MODEL = LinearCostModel(fixed_s=1e-3, per_token_s=1e-5, per_attended_s=1e-8)


@pytest.mark.parametrize(
    "cached, remaining, budget, cap",
    [
        (0, 5000, 5e-3, 4096),  # budget binds
        (0, 300, 1.0, 4096),  # remaining binds
        (0, 5000, 1.0, 256),  # cap binds
        (2000, 5000, 5e-3, 4096),  # a longer cache leaves room for fewer tokens
        (0, 5000, 1e-4, 4096),  # nothing fits: still 1
        (0, 0, 1.0, 4096),  # nothing remaining: still 1
        (100, 777, 3e-3, 500),
    ],
)
def test_largest_chunk_matches_brute_force(cached, remaining, budget, cap):
    got = largest_chunk(MODEL, cached, remaining, budget, cap=cap)
    assert got == _brute_force(MODEL, cached, remaining, budget, cap)
    assert 1 <= got <= max(1, min(remaining, cap))
    if got > 1:
        assert MODEL.cost(got, cached + got) <= budget
    if got < min(remaining, cap):
        assert MODEL.cost(got + 1, cached + got + 1) > budget


def test_largest_chunk_exact_values():
    # cost = q seconds: the chunk is the largest integer within the budget
    class PerToken:
        def cost(self, q_tokens, ctx_tokens):
            return float(q_tokens)

    assert largest_chunk(PerToken(), 0, 1000, 37.5) == 37
    assert largest_chunk(PerToken(), 0, 1000, 37.0) == 37
    assert largest_chunk(PerToken(), 0, 20, 37.0) == 20
    assert largest_chunk(PerToken(), 0, 1000, 37.0, cap=10) == 10
    assert largest_chunk(PerToken(), 0, 1000, 0.0) == 1


def test_default_cap_is_max_prefill_chunk():
    free = LinearCostModel(fixed_s=0.0, per_token_s=0.0, per_attended_s=0.0)
    assert largest_chunk(free, 0, 10**6, 1.0) == MAX_PREFILL_CHUNK == 32_768
    assert largest_chunk(free, 0, 1234, 1.0) == 1234


def test_tighter_budget_or_longer_cache_never_gives_a_bigger_chunk():
    budgets = [1e-4, 1.2e-3, 2e-3, 4e-3, 8e-3, 2e-2, 0.1, 1.0]
    for cached, remaining in itertools.product([0, 500, 5000], [1, 100, 20_000]):
        chunks = [largest_chunk(MODEL, cached, remaining, b) for b in budgets]
        assert chunks == sorted(chunks), (cached, remaining, chunks)
    for budget in budgets:
        chunks = [largest_chunk(MODEL, c, 20_000, budget) for c in (0, 100, 1000, 10_000, 100_000)]
        assert chunks == sorted(chunks, reverse=True), (budget, chunks)
    # and the budgets do span small to capped chunks
    assert largest_chunk(MODEL, 0, 20_000, budgets[0]) == 1
    assert largest_chunk(MODEL, 0, 20_000, budgets[-1]) > 1000
