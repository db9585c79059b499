"""Expert-parallel dispatch/combine over HCCL with torch_npu's fused MC2 ops (npu_moe_distribute_dispatch /
npu_moe_distribute_combine): tokens travel to the ranks owning their experts and back in one op each,
and combine applies the routing weights itself."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from deepinfer_core.parallel.communicator import Dispatched

__all__ = ["McDistributeCommunicator"]


@dataclass(frozen=True, slots=True)
class _Handle:
    expert_ids: torch.Tensor  # [T, K] int32, as dispatched
    expand_idx: torch.Tensor  # where each (token, k) row went, for combine
    ep_recv_counts: torch.Tensor  # rows received from each rank (combine sends them back)
    num_experts: int


class McDistributeCommunicator:
    """One rank of an expert-parallel group named `group_name` (HCCL's communicator name for the group).

    Experts are placed contiguously, as in core: rank r owns experts [r * E / W, (r + 1) * E / W).
    """

    def __init__(self, npu: ModuleType, group_name: str, world_size: int, rank: int) -> None:
        self.npu, self.group_name = npu, group_name
        self.world_size, self.rank = world_size, rank

    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> Dispatched:
        if num_experts % self.world_size:
            raise ValueError(f"{num_experts} experts cannot be split evenly over {self.world_size} ranks")
        expert_ids = topk_ids.to(torch.int32)
        expand_x, _scales, expand_idx, expert_token_nums, ep_recv_counts, _tp, _expand_scales = (
            self.npu.npu_moe_distribute_dispatch(
                hidden,
                expert_ids,
                self.group_name,
                self.world_size,
                self.rank,
                num_experts,
                expert_token_nums_type=1,  # per local expert counts, not a running sum
            )
        )
        handle = _Handle(expert_ids, expand_idx, ep_recv_counts, num_experts)
        return Dispatched(expand_x, expert_token_nums.to(torch.int64), handle)

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched, topk_weights: torch.Tensor) -> torch.Tensor:
        handle: _Handle = dispatched.handle
        return self.npu.npu_moe_distribute_combine(
            expert_out,
            handle.expert_ids,
            handle.expand_idx,
            handle.ep_recv_counts,
            topk_weights.float(),
            self.group_name,
            self.world_size,
            self.rank,
            handle.num_experts,
        )
