"""Expert-parallel load balancing (EPLB): where each MoE layer's experts and their redundant copies live.

DeepSeek's balancing algorithm (github.com/deepseek-ai/EPLB), re-derived here, as three greedy steps per layer:

1. groups to nodes (only when the expert groups divide evenly among the nodes: the "hierarchical" policy,
   which keeps a group's traffic on one node; otherwise one node and one group, the "global" policy): the
   heaviest group first, each into the lightest node that has room for it, every node taking as many groups;
2. redundant copies inside each node: one copy of every expert, then each further copy to the expert whose
   load per copy is highest (its load is split evenly between its copies);
3. copies to ranks inside each node, as step 1 packs groups: heaviest first into the lightest rank with room.

Ties break to the lowest index everywhere (the expert, the node, the rank), which makes the placement a pure
function of the loads: every rank computes the same one. The published example in deepseek-ai/EPLB's README
comes out the same (tests/parallel/test_eplb.py). Loads are any non-negative counts, e.g. tokens per expert
over a window of steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ExpertPlacement", "balance_ratio", "contiguous", "balanced_packing", "rebalance", "replicate"]


@dataclass(frozen=True, slots=True)
class ExpertPlacement:
    """Per MoE layer: physical expert slot p (rank p // (P / ranks)) holds logical expert `physical_to_logical[l,
    p]`, as that expert's copy number `replica_rank[l, p]`; `logical_count[l, e]` copies of expert e exist, at
    slots `logical_to_physical[l, e, :count]` (the rest -1)."""

    physical_to_logical: torch.Tensor  # [L, P] int64
    replica_rank: torch.Tensor  # [L, P] int64
    logical_count: torch.Tensor  # [L, E] int64
    logical_to_physical: torch.Tensor  # [L, E, max copies] int64, -1 past an expert's count

    @property
    def num_physical(self) -> int:
        return self.physical_to_logical.shape[1]

    def rank_loads(self, load: torch.Tensor, num_ranks: int) -> torch.Tensor:
        """load [L, E] -> [L, num_ranks]: each rank's share, an expert's load split evenly between its copies."""
        per_copy = load.float() / self.logical_count  # [L, E]
        return per_copy.gather(1, self.physical_to_logical).view(load.shape[0], num_ranks, -1).sum(dim=2)

    def experts_on(self, rank: int, num_ranks: int) -> torch.Tensor:
        """[L, P / num_ranks]: the logical experts rank `rank` holds, slot by slot."""
        per_rank = self.num_physical // num_ranks
        return self.physical_to_logical[:, rank * per_rank : (rank + 1) * per_rank]


def balance_ratio(rank_loads: torch.Tensor) -> torch.Tensor:
    """rank_loads [L, W] -> [L]: the busiest rank's load over the mean rank's (DeepSeek's moe_lb ratio; 1 is even).
    A layer with no load is 1."""
    mean = rank_loads.float().mean(dim=1)
    return torch.where(mean > 0, rank_loads.float().max(dim=1).values / mean.clamp_min(1e-30), torch.ones_like(mean))


def contiguous(num_layers: int, num_experts: int, num_ranks: int) -> ExpertPlacement:
    """The placement without balancing: no copies, rank r holding experts [r E / W, (r + 1) E / W)."""
    if num_experts % num_ranks:
        raise ValueError(f"{num_experts} experts do not split evenly into {num_ranks} ranks; give redundant copies")
    logical = torch.arange(num_experts).repeat(num_layers, 1)
    return ExpertPlacement(logical, torch.zeros_like(logical), torch.ones_like(logical), logical.clone()[:, :, None])


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [L, N] (N a multiple of num_packs) -> (pack [L, N], slot in its pack [L, N]): per row, N / num_packs
    items a pack, the heaviest item first into the lightest pack with room (ties: the lowest pack)."""
    rows, items = weight.shape
    if items % num_packs:
        raise ValueError(f"{items} items do not split evenly into {num_packs} packs")
    per_pack = items // num_packs
    pack = torch.empty((rows, items), dtype=torch.int64)
    slot = torch.empty((rows, items), dtype=torch.int64)
    order = weight.float().sort(dim=1, descending=True, stable=True).indices  # heaviest first, ties by index
    values = weight.double().tolist()
    for row in range(rows):
        loads, filled = [0.0] * num_packs, [0] * num_packs
        for item in order[row].tolist():
            target = min((p for p in range(num_packs) if filled[p] < per_pack), key=loads.__getitem__)
            pack[row, item], slot[row, item] = target, filled[target]
            loads[target] += values[row][item]
            filled[target] += 1
    return pack, slot


def replicate(weight: torch.Tensor, num_physical: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [L, E] -> (logical expert of each of num_physical copies [L, P], its copy number [L, P], copies of
    each expert [L, E]): copy e is expert e for e < E; each further copy goes to the expert with the highest load
    per copy (ties: the lowest expert)."""
    rows, experts = weight.shape
    if num_physical < experts:
        raise ValueError(f"{num_physical} physical experts cannot hold {experts} logical ones")
    logical = torch.arange(num_physical, dtype=torch.int64).repeat(rows, 1)
    copy_number = torch.zeros((rows, num_physical), dtype=torch.int64)
    count = torch.ones((rows, experts), dtype=torch.int64)
    every_row = torch.arange(rows)
    for p in range(experts, num_physical):
        busiest = (weight / count).max(dim=1).indices  # [L]: the first of equal maxima
        logical[:, p] = busiest
        copy_number[:, p] = count[every_row, busiest]
        count[every_row, busiest] += 1
    return logical, copy_number, count


def _inverse(permutation: torch.Tensor) -> torch.Tensor:
    """Row-wise inverse of permutations [L, N]."""
    inverse = torch.empty_like(permutation)
    positions = torch.arange(permutation.shape[1], dtype=torch.int64).expand_as(permutation)
    return inverse.scatter_(1, permutation, positions)


def rebalance(
    load: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int, num_ranks: int
) -> ExpertPlacement:
    """The placement of load [L, E]'s experts into num_physical slots (a multiple of num_ranks, at least E) over
    num_ranks ranks on num_nodes nodes; num_groups expert groups (DeepSeek-V3's group-limited routing; 1 for none).
    Hierarchical when the groups divide among the nodes (and the ranks among the nodes), else global."""
    layers, experts = load.shape
    if num_physical % num_ranks or num_physical < experts:
        raise ValueError(
            f"num_physical ({num_physical}) must be a multiple of the ranks ({num_ranks}) and at least the "
            f"experts ({experts})"
        )
    load = load.detach().float().cpu()
    if not (num_groups % num_nodes == 0 and num_ranks % num_nodes == 0 and experts % num_groups == 0):
        num_groups = num_nodes = 1  # the global policy
    physical_to_logical, replica_rank, count = _hierarchical(load, num_physical, num_groups, num_nodes, num_ranks)
    most = int(count.max())
    logical_to_physical = torch.full((layers, experts, most), -1, dtype=torch.int64)
    logical_to_physical.view(layers, -1).scatter_(
        1, physical_to_logical * most + replica_rank, torch.arange(num_physical).expand(layers, -1)
    )
    return ExpertPlacement(physical_to_logical, replica_rank, count, logical_to_physical)


def _hierarchical(load: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int, num_ranks: int):
    """The three steps of the module docstring -> (physical_to_logical, replica_rank, logical_count)."""
    layers, experts = load.shape
    group_size, groups_per_node = experts // num_groups, num_groups // num_nodes
    experts_per_node, physical_per_node = experts // num_nodes, num_physical // num_nodes
    slots_per_rank = num_physical // num_ranks
    # 1. groups to nodes; "node order": experts renumbered node by node, a node's groups in their slot order
    group_node, group_slot = balanced_packing(load.view(layers, num_groups, group_size).sum(dim=2), num_nodes)
    first = (group_node * groups_per_node + group_slot) * group_size  # [L, G]: each group's first renumbered expert
    to_node_order = (first[:, :, None] + torch.arange(group_size)).flatten(1)  # [L, E]: expert -> renumbered
    from_node_order = _inverse(to_node_order)
    # 2. copies inside each node, over the node's experts in node order
    node_load = load.gather(1, from_node_order).view(layers * num_nodes, experts_per_node)
    copy_expert, copy_number, copies = replicate(node_load, physical_per_node)  # [L * nodes, P / nodes]
    # 3. copies to the node's ranks by their load per copy
    copy_load = (node_load / copies).gather(1, copy_expert)
    copy_rank, rank_slot = balanced_packing(copy_load, num_ranks // num_nodes)
    slot_of_copy = copy_rank * slots_per_rank + rank_slot  # [L * nodes, P / nodes]: copy -> physical slot
    copy_at_slot = _inverse(slot_of_copy)
    node_expert_at_slot = copy_expert.gather(1, copy_at_slot).view(layers, num_nodes, physical_per_node)
    node_expert_at_slot = node_expert_at_slot + (torch.arange(num_nodes) * experts_per_node)[None, :, None]
    physical_to_logical = from_node_order.gather(1, node_expert_at_slot.flatten(1))
    replica_rank = copy_number.gather(1, copy_at_slot).view(layers, num_physical)
    logical_count = copies.view(layers, experts).gather(1, to_node_order)
    return physical_to_logical, replica_rank, logical_count
