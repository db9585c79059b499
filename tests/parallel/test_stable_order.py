"""In-process dispatch groups pairs by expert in the order of a stable sort, by counting or by sorting."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.parallel import communicator
from deepinfer_core.parallel.communicator import _stable_order


@pytest.mark.parametrize("pairs,experts", [(1, 4), (7, 3), (384, 64), (1536, 64), (5000, 256)])
def test_counting_order_is_the_stable_sort(pairs, experts):
    ids = torch.randint(0, experts, (pairs,), generator=torch.Generator().manual_seed(pairs))
    assert torch.equal(_stable_order(ids, experts), torch.argsort(ids, stable=True))


def test_large_inputs_take_the_sort_and_agree(monkeypatch):
    ids = torch.randint(0, 8, (300,), generator=torch.Generator().manual_seed(1))
    counted = _stable_order(ids, 8)
    monkeypatch.setattr(communicator, "_RANK_BY_COUNTING_MAX", 0)  # force the sorting branch
    assert torch.equal(_stable_order(ids, 8), counted)
