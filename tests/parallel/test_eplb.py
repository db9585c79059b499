"""The expert-parallel load balancer's placement (deepinfer_core/parallel/eplb.py): DeepSeek's published example,
the invariants of any placement, and that balancing does balance."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_core.parallel.eplb import balance_ratio, balanced_packing, contiguous, rebalance, replicate

# deepseek-ai/EPLB's README: two MoE layers of 12 experts in 4 groups, 16 physical slots, 2 nodes of 4 GPUs
README_LOAD = torch.tensor(
    [
        [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
        [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
    ]
)
README_PHYSICAL_TO_LOGICAL = torch.tensor(
    [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
)


def test_deepseeks_published_example():
    placement = rebalance(README_LOAD, num_physical=16, num_groups=4, num_nodes=2, num_ranks=8)
    assert torch.equal(placement.physical_to_logical, README_PHYSICAL_TO_LOGICAL)


def test_packing_by_hand():
    # heaviest first into the lightest pack with room, two items a pack: 9 -> pack 0 (a tie: the lowest),
    # 7 -> pack 1 (0 < 9), 5 -> pack 1 (7 < 9; now full), 1 -> pack 0
    pack, slot = balanced_packing(torch.tensor([[5.0, 9.0, 1.0, 7.0]]), 2)
    assert pack.tolist() == [[1, 0, 0, 1]]
    assert slot.tolist() == [[1, 0, 1, 0]]


def test_replication_by_hand():
    # loads 10, 4: copies go to 10 (10/1), then 10 again (10/2 = 5 > 4), then 4 (10/3 = 3.3 < 4)
    logical, number, count = replicate(torch.tensor([[10.0, 4.0]]), 5)
    assert logical.tolist() == [[0, 1, 0, 0, 1]]
    assert number.tolist() == [[0, 0, 1, 2, 1]]
    assert count.tolist() == [[3, 2]]


def check_placement(placement, load, num_ranks: int) -> None:
    """Every invariant a placement keeps, whatever the loads."""
    layers, experts = load.shape
    p2l, count, l2p = placement.physical_to_logical, placement.logical_count, placement.logical_to_physical
    assert p2l.shape == (layers, placement.num_physical) and placement.num_physical % num_ranks == 0
    for layer in range(layers):
        assert torch.equal(torch.bincount(p2l[layer], minlength=experts), count[layer])  # counts are the copies
        assert int(count[layer].min()) >= 1  # every expert somewhere
        for expert in range(experts):
            slots = l2p[layer, expert, : count[layer, expert]]
            assert (p2l[layer, slots] == expert).all()  # the two maps agree
            assert (l2p[layer, expert, count[layer, expert] :] == -1).all()
            assert sorted(placement.replica_rank[layer, slots].tolist()) == list(range(int(count[layer, expert])))
    loads = placement.rank_loads(load, num_ranks)
    torch.testing.assert_close(loads.sum(dim=1), load.float().sum(dim=1))  # load split, not lost or made


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(1, 3),
    groups=st.sampled_from([1, 2, 4]),
    group_size=st.integers(1, 4),
    nodes=st.sampled_from([1, 2, 3]),
    ranks_per_node=st.integers(1, 3),
    extra=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_any_placement_keeps_the_invariants(layers, groups, group_size, nodes, ranks_per_node, extra, seed):
    experts, ranks = groups * group_size, nodes * ranks_per_node
    physical = -(-experts // ranks) * ranks + extra * ranks  # at least E, a multiple of the ranks (any, e.g. 3)
    load = torch.randint(0, 1000, (layers, experts), generator=torch.Generator().manual_seed(seed))
    placement = rebalance(load, physical, groups, nodes, ranks)
    check_placement(placement, load, ranks)
    if groups % nodes == 0:  # hierarchical: a group's experts and all their copies stay on one node
        per_node = physical // nodes
        node_of_slot = torch.arange(physical) // per_node
        for layer in range(layers):
            for group in range(groups):
                members = range(group * group_size, (group + 1) * group_size)
                nodes_used = {
                    int(node_of_slot[s])
                    for s in range(physical)
                    if int(placement.physical_to_logical[layer, s]) in members
                }
                assert len(nodes_used) == 1, (layer, group, nodes_used)


def test_balancing_a_skewed_load_beats_the_contiguous_placement():
    # Zipf-like loads over 64 experts on 8 ranks: a few hot experts
    generator = torch.Generator().manual_seed(0)
    load = (1000.0 / torch.arange(1, 65).float())[torch.randperm(64, generator=generator)][None, :]
    before = balance_ratio(contiguous(1, 64, 8).rank_loads(load, 8))
    after = balance_ratio(rebalance(load, 64 + 8, num_groups=8, num_nodes=1, num_ranks=8).rank_loads(load, 8))
    assert float(after[0]) < float(before[0])
    assert float(after[0]) < 1.1, float(after[0])


def test_a_uniform_load_is_even_and_idle_layers_count_as_even():
    loads = rebalance(torch.ones(1, 16), 16, 1, 1, 4).rank_loads(torch.ones(1, 16), 4)
    assert float(balance_ratio(loads)[0]) == 1.0
    assert float(balance_ratio(torch.zeros(1, 4))[0]) == 1.0


@pytest.mark.parametrize(
    ("physical", "ranks", "message"), [(17, 4, "multiple of the ranks"), (8, 4, "at least the experts")]
)
def test_impossible_sizes_are_refused(physical, ranks, message):
    with pytest.raises(ValueError, match=message):
        rebalance(torch.ones(1, 12), physical, 1, 1, ranks)
