"""Expert-parallel dispatch/combine: send each token to the ranks owning its experts, and back.

Experts are placed contiguously: rank r owns experts [r * E / W, (r + 1) * E / W). A communicator
turns a rank's tokens and their routing into rows grouped by local expert (the input of the grouped
expert GEMM), and turns the expert outputs back into one weighted sum per token. Two implementations
live here: `InProcessCommunicator` (world size 1, no transport) and `AllToAllCommunicator`
(torch.distributed all-to-all over whatever process group it is given). Backends may supply a fused
transport through the communicator hook; the semantics stay the ones below.

Combine sums a token's top_k contributions in routing order (k = 0, 1, ...) in float32, so the result
does not depend on the world size. Given `topk_weights`, dispatch also brings each row its routing weight
(`Dispatched.row_weights`), for models that apply it inside the expert (DeepSeek-V4.1: `expert_ffn`'s
`row_scales`); their combine then takes weights of 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["AllToAllCommunicator", "Dispatched", "ExpertCommunicator", "InProcessCommunicator"]


@dataclass(frozen=True, slots=True)
class Dispatched:
    """Rows for this rank's experts, grouped by local expert, plus what combine needs to undo it."""

    hidden: torch.Tensor  # [N, D] rows sorted by local expert
    tokens_per_expert: torch.Tensor  # [E_local] int64, sums to N
    handle: Any  # communicator-private state for combine
    row_weights: torch.Tensor | None = None  # [N] float32: each row's routing weight, when dispatch was given them


@runtime_checkable
class ExpertCommunicator(Protocol):
    rank: int
    world_size: int

    def dispatch(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, topk_weights: torch.Tensor | None = None
    ) -> Dispatched:
        """hidden [T, D] and topk_ids [T, K] (global expert ids) -> this rank's expert rows; with
        topk_weights [T, K], each row's weight (float32) in `row_weights`."""
        ...

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched, topk_weights: torch.Tensor) -> torch.Tensor:
        """expert_out [N, D] (rows of `dispatched`) and topk_weights [T, K] -> [T, D] weighted sums."""
        ...

    def exchange(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """All-to-all of whole rows: rows [sum(send_counts), ...] go to the ranks in rank order (send_counts[r] to
        rank r); returns [sum(recv_counts), ...], rank 0's first. EPLB moves expert weights with it."""
        ...


def _weighted_sum(pair_rows: torch.Tensor, topk_weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """pair_rows [T*K, D] in (token, k) order -> sum_k w[t, k] * row[t, k] in float32 -> [T, D]."""
    tokens, top_k = topk_weights.shape
    rows = pair_rows.view(tokens, top_k, pair_rows.shape[-1]).float()  # not -1: ambiguous when tokens == 0
    return (rows * topk_weights.float()[:, :, None]).sum(dim=1).to(out_dtype)


class InProcessCommunicator:
    """World size 1: every expert is local; dispatch is a sort by expert id."""

    rank = 0
    world_size = 1

    def dispatch(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, topk_weights: torch.Tensor | None = None
    ) -> Dispatched:
        flat_ids = topk_ids.reshape(-1)  # [T*K]
        order = torch.argsort(flat_ids, stable=True)  # pair indices grouped by expert
        rows = hidden[order // topk_ids.shape[1]]  # [T*K, D]
        counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_ids.device)
        counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))  # not bincount: it reads its max on the host
        weights = None if topk_weights is None else topk_weights.reshape(-1).float()[order]
        return Dispatched(rows, counts, order, weights)

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched, topk_weights: torch.Tensor) -> torch.Tensor:
        pair_rows = torch.empty_like(expert_out)
        pair_rows[dispatched.handle] = expert_out  # back to (token, k) order
        return _weighted_sum(pair_rows, topk_weights, expert_out.dtype)

    def exchange(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        return rows.clone()  # one rank: what it sends is what it receives


@dataclass(frozen=True, slots=True)
class _AllToAllHandle:
    send_order: torch.Tensor  # [T*K] pair indices in the order they were sent
    send_counts: list[int]  # rows sent to each rank
    recv_counts: list[int]  # rows received from each rank
    recv_order: torch.Tensor  # [N] received-row indices sorted by local expert


class AllToAllCommunicator:
    """Dispatch/combine with torch.distributed.all_to_all_single over `group` (gloo, or a device's own)."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("AllToAllCommunicator needs torch.distributed.init_process_group() first")
        self._dist = dist
        self._group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def exchange(self, tensor: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        out = tensor.new_empty((sum(recv_counts), *tensor.shape[1:]))
        self._dist.all_to_all_single(out, tensor.contiguous(), recv_counts, send_counts, group=self._group)
        return out

    def dispatch(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, topk_weights: torch.Tensor | None = None
    ) -> Dispatched:
        if num_experts % self.world_size:
            raise ValueError(f"{num_experts} experts cannot be split evenly over {self.world_size} ranks")
        local_experts = num_experts // self.world_size
        flat_ids = topk_ids.reshape(-1)
        send_order = torch.argsort(flat_ids, stable=True)  # grouped by expert, hence by rank
        send_ids = flat_ids[send_order]
        send_counts = torch.bincount(send_ids // local_experts, minlength=self.world_size)
        counts = torch.empty_like(send_counts)
        self._dist.all_to_all_single(counts, send_counts, group=self._group)
        send_list, recv_list = send_counts.tolist(), counts.tolist()
        rows = self.exchange(hidden[send_order // topk_ids.shape[1]], send_list, recv_list)
        local_ids = self.exchange(send_ids, send_list, recv_list) - self.rank * local_experts
        recv_order = torch.argsort(local_ids, stable=True)
        tokens_per_expert = torch.bincount(local_ids, minlength=local_experts)
        handle = _AllToAllHandle(send_order, send_list, recv_list, recv_order)
        weights = None
        if topk_weights is not None:  # travel with their rows
            weights = self.exchange(topk_weights.reshape(-1).float()[send_order], send_list, recv_list)[recv_order]
        return Dispatched(rows[recv_order], tokens_per_expert, handle, weights)

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched, topk_weights: torch.Tensor) -> torch.Tensor:
        handle: _AllToAllHandle = dispatched.handle
        received_order = torch.empty_like(expert_out)
        received_order[handle.recv_order] = expert_out
        returned = self.exchange(received_order, handle.recv_counts, handle.send_counts)  # [T*K, D]
        pair_rows = torch.empty_like(returned)
        pair_rows[handle.send_order] = returned
        return _weighted_sum(pair_rows, topk_weights, expert_out.dtype)
