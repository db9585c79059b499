"""A MoE layer's physical expert slots: which expert (and which copy of it) each slot holds, and the routing of a
token's experts to slots. Slot p lives on rank p // (P / world size) (contiguous blocks, as the communicator
splits them).

Without redundant copies and with the experts dividing evenly among the ranks, slot e is expert e and routing is
the identity. Otherwise (a world size that does not divide the experts, or an EPLB placement) an expert may have
several copies, and the token at row t of a step takes copy t mod copies of each of its experts: the tokens of a
hot expert spread evenly over its copies, by a rule every rank applies alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_core.parallel.eplb import ExpertPlacement, rebalance

__all__ = ["ExpertSlots"]


@dataclass(frozen=True, slots=True)
class ExpertSlots:
    physical_to_logical: tuple[int, ...]  # [P]: the expert each slot holds (host metadata, not a tensor)
    copies: torch.Tensor | None  # [E] int64: how many slots hold each expert (on the layer's device; None: identity)
    logical_to_physical: torch.Tensor | None  # [E, most copies] int64: an expert's slots, -1 past its count
    identity: bool  # slot e is expert e, one copy each: routing changes nothing

    @property
    def num_physical(self) -> int:
        return len(self.physical_to_logical)

    @classmethod
    def default(cls, num_experts: int, world_size: int, device: torch.device | str = "cpu") -> ExpertSlots:
        """One copy per expert where the ranks divide the experts; else the fewest copies that fill whole ranks,
        placed as EPLB places them under even loads."""
        if num_experts % world_size == 0:
            return cls(tuple(range(num_experts)), None, None, True)
        physical = -(-num_experts // world_size) * world_size
        return cls.from_placement(rebalance(torch.ones(1, num_experts), physical, 1, 1, world_size), 0, device)

    @classmethod
    def from_placement(cls, placement: ExpertPlacement, layer: int, device: torch.device | str = "cpu") -> ExpertSlots:
        """Layer `layer` of an EPLB placement."""
        return cls(
            tuple(placement.physical_to_logical[layer].tolist()),
            placement.logical_count[layer].to(device),
            placement.logical_to_physical[layer].to(device),
            False,
        )

    def held_by(self, rank: int, world_size: int) -> list[int]:
        """The experts rank `rank` holds, slot by slot."""
        per_rank = self.num_physical // world_size
        return list(self.physical_to_logical[rank * per_rank : (rank + 1) * per_rank])

    def route(self, expert_ids: torch.Tensor) -> torch.Tensor:
        """expert_ids [T, K] -> the slots [T, K] that serve them (copy t mod copies for the token of row t)."""
        if self.identity:
            return expert_ids
        rows = torch.arange(expert_ids.shape[0], device=expert_ids.device)[:, None]  # [T, 1]
        choice = rows % self.copies[expert_ids]  # [T, K]
        return self.logical_to_physical[expert_ids, choice]
