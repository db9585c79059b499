"""Expert-parallel dispatch/combine over HCCL with torch_npu's fused MC2 ops (npu_moe_distribute_dispatch /
npu_moe_distribute_combine): tokens travel to the ranks owning their experts and back in one op each,
and combine applies the routing weights itself.

The ops take at most MAX_TOKENS_PER_CALL tokens a call (documented: 512 on Atlas A3 and Ascend 950DT,
256 on A2), so a step is sent in chunks; the chunks' rows are then regrouped by local expert for the
grouped GEMM, and put back in chunk order for combine.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.distributed

from deepinfer_core.parallel.communicator import Dispatched

__all__ = ["MAX_TOKENS_PER_CALL", "McDistributeCommunicator"]

MAX_TOKENS_PER_CALL = 256  # the smallest documented limit, so the same code runs on every product


@dataclass(frozen=True, slots=True)
class _Chunk:
    """What combine needs of one dispatch call: its outputs, passed back unchanged, and its row counts."""

    expert_ids: torch.Tensor  # [t, K] int32
    expand_idx: torch.Tensor
    ep_recv_counts: torch.Tensor
    tp_recv_counts: torch.Tensor
    expand_scales: torch.Tensor
    rows: int  # real rows of this chunk (expand_x may be padded past them)
    padded_rows: int  # rows of expand_x as dispatch returned it


@dataclass(frozen=True, slots=True)
class _Handle:
    chunks: list[_Chunk]
    order: torch.Tensor  # [N] merged row i came from row order[i] of the chunks' rows, concatenated
    num_experts: int


class McDistributeCommunicator:
    """One rank of an expert-parallel group named `group_name` (HCCL's communicator name for the group).

    Experts are placed contiguously, as in core: rank r owns experts [r * E / W, (r + 1) * E / W).
    """

    def __init__(self, npu: ModuleType, group_name: str, world_size: int, rank: int) -> None:
        self.npu, self.group_name = npu, group_name
        self.world_size, self.rank = world_size, rank

    def exchange(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """EPLB's weight moves: torch.distributed's all_to_all_single over the default group (HCCL under
        torch_npu), rows split by rank."""
        out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
        torch.distributed.all_to_all_single(out, rows.contiguous(), recv_counts, send_counts)
        return out

    def dispatch(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, topk_weights: torch.Tensor | None = None
    ) -> Dispatched:
        if topk_weights is not None:  # only DeepSeek-V4.1 asks, and this backend refuses V4.1 (expert_row_scales)
            raise NotImplementedError(
                "ascend950's MC2 dispatch does not carry routing weights to the experts (expert_row_scales): "
                "run DeepSeek-V4.1 on a backend that has them"
            )
        if num_experts % self.world_size:
            raise ValueError(f"{num_experts} experts cannot be split evenly over {self.world_size} ranks")
        local_experts = num_experts // self.world_size
        chunks, pieces, counts = [], [], []
        for start in range(0, hidden.shape[0], MAX_TOKENS_PER_CALL):
            part = slice(start, start + MAX_TOKENS_PER_CALL)
            expert_ids = topk_ids[part].to(torch.int32).contiguous()
            expand_x, _scales, expand_idx, token_nums, ep_recv, tp_recv, expand_scales = (
                self.npu.npu_moe_distribute_dispatch(
                    hidden[part].contiguous(),
                    expert_ids,
                    self.group_name,
                    self.world_size,
                    self.rank,
                    num_experts,
                    global_bs=MAX_TOKENS_PER_CALL * self.world_size,  # ranks may send different counts
                    expert_token_nums_type=1,  # per local expert counts, not a running sum
                )
            )
            per_expert = token_nums.to(torch.int64).tolist()[:local_experts]  # host: rows to keep and regroup
            rows = sum(per_expert)
            chunks.append(_Chunk(expert_ids, expand_idx, ep_recv, tp_recv, expand_scales, rows, expand_x.shape[0]))
            pieces.append(expand_x[:rows])
            counts.append(per_expert)
        order = _expert_major_order(counts)
        merged = torch.cat(pieces)[order.to(hidden.device)] if pieces else hidden.new_empty((0, hidden.shape[1]))
        tokens_per_expert = torch.tensor([sum(c[e] for c in counts) for e in range(local_experts)])
        handle = _Handle(chunks, order.to(hidden.device), num_experts)
        return Dispatched(merged, tokens_per_expert.to(hidden.device), handle)

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched, topk_weights: torch.Tensor) -> torch.Tensor:
        handle: _Handle = dispatched.handle
        chunk_rows = torch.empty_like(expert_out)
        chunk_rows[handle.order] = expert_out  # back to the chunks' own row order
        outputs, start, token = [], 0, 0
        for chunk in handle.chunks:
            rows = chunk_rows[start : start + chunk.rows]
            padded = torch.zeros((chunk.padded_rows, rows.shape[1]), dtype=rows.dtype, device=rows.device)
            padded[: chunk.rows] = rows
            tokens = chunk.expert_ids.shape[0]
            outputs.append(
                self.npu.npu_moe_distribute_combine(
                    padded,
                    chunk.expert_ids,
                    chunk.expand_idx,
                    chunk.ep_recv_counts,
                    topk_weights[token : token + tokens].float().contiguous(),
                    self.group_name,
                    self.world_size,
                    self.rank,
                    handle.num_experts,
                    tp_send_counts=chunk.tp_recv_counts,
                    expand_scales=chunk.expand_scales,
                    global_bs=MAX_TOKENS_PER_CALL * self.world_size,
                )
            )
            start, token = start + chunk.rows, token + tokens
        if not outputs:
            return expert_out.new_empty((0, expert_out.shape[1]))
        return torch.cat(outputs)


def _expert_major_order(counts: list[list[int]]) -> torch.Tensor:
    """Chunks' rows (each chunk grouped by expert) -> the order grouping all of them by expert, chunk by
    chunk within an expert: merged row i is row order[i] of the chunks' rows concatenated."""
    chunk_starts, total = [], 0
    for per_expert in counts:
        chunk_starts.append(total)
        total += sum(per_expert)
    order: list[int] = []
    for expert in range(len(counts[0]) if counts else 0):
        for chunk, per_expert in enumerate(counts):
            first = chunk_starts[chunk] + sum(per_expert[:expert])
            order.extend(range(first, first + per_expert[expert]))
    return torch.tensor(order, dtype=torch.int64)
