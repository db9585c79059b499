"""Paged attention (deepinfer_core.backend.ops.AttentionOps) over HeadMajorKVLayout, one query row at a time
with an online (flash-style) softmax; imports only torch, deepinfer_core.backend and deepinfer_core.kv.layout.

For each query row the sequence's blocks are visited in order, keeping a running max m, running sum l and
a rescaled accumulator in float32. A row's arithmetic depends only on its own position and the cached
entries, never on the other rows of the step: batch-invariant and chunk-invariant.
"""

from __future__ import annotations

import torch

from deepinfer_core.backend.ops import AttentionMetadata
from deepinfer_core.kv.layout import CacheKind, CacheSpec
from deepinfer_rowwise_cpu.kernels import fresh_row
from deepinfer_rowwise_cpu.kv import HeadMajorKVLayout

__all__ = ["OnlineSoftmaxAttention"]


class OnlineSoftmaxAttention:
    def __init__(self, layout: HeadMajorKVLayout) -> None:
        if not isinstance(layout, HeadMajorKVLayout):
            raise TypeError(f"rowwise_cpu attention reads its own HeadMajorKVLayout, not {type(layout).__name__}")
        self.layout = layout

    def paged_attention(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        spec: CacheSpec,
        meta: AttentionMetadata,
        *,
        scale: float,
        value_dim: int,
        value_offset: int = 0,
    ) -> torch.Tensor:
        if spec.kind is not CacheKind.PAGED:
            raise ValueError(f"paged_attention reads a PAGED cache, not {spec.kind.value}")
        num_heads = q.shape[1]
        if num_heads % spec.num_heads:
            raise ValueError(f"{num_heads} query heads do not share {spec.num_heads} cached heads evenly")
        out = torch.zeros(q.shape[0], num_heads, value_dim, dtype=q.dtype, device=q.device)  # [T, H, Dv]
        starts = meta.query_start_loc.tolist()
        for b, seq_len in enumerate(meta.seq_lens.tolist()):
            q_start, q_end = starts[b], starts[b + 1]
            if q_end == q_start:
                continue  # no queries for this sequence in this step
            table = meta.block_tables[b].tolist()
            first_pos = seq_len - (q_end - q_start)  # absolute position of the sequence's first query
            for t in range(q_start, q_end):
                context = first_pos + (t - q_start) + 1  # causal: positions 0..pos
                out[t] = self._row(q[t], cache, spec, table, context, scale, value_dim, value_offset)
        return out

    def _row(
        self,
        q_row: torch.Tensor,
        cache: torch.Tensor,
        spec: CacheSpec,
        table: list[int],
        context: int,
        scale: float,
        value_dim: int,
        value_offset: int,
    ) -> torch.Tensor:
        """One query row q_row [H, Dk] over the first `context` cached tokens -> [H, value_dim] float32."""
        kv_heads, key_dim = spec.num_heads, q_row.shape[-1]
        group = q_row.shape[0] // kv_heads  # query heads per cached head (GQA; MLA has kv_heads 1)
        query = fresh_row(q_row).view(kv_heads, group, key_dim)  # [Hkv, G, Dk]
        run_max = torch.full((kv_heads, group, 1), float("-inf"), device=query.device)  # m
        run_sum = torch.zeros(kv_heads, group, 1, device=query.device)  # l
        acc = torch.zeros(kv_heads, group, value_dim, device=query.device)  # sum of exp(s - m) * v
        block_size = self.layout.block_size
        for j in range(-(-context // block_size)):
            valid = min(block_size, context - j * block_size)
            entries = self.layout.block(cache, table[j], valid).float()  # [Hkv, n, Dc]
            keys = entries[..., :key_dim]  # [Hkv, n, Dk]
            values = entries[..., value_offset : value_offset + value_dim]  # [Hkv, n, Dv]
            scores = torch.bmm(query, keys.transpose(1, 2)) * scale  # [Hkv, G, n]
            new_max = torch.maximum(run_max, scores.amax(dim=-1, keepdim=True))  # finite: block 0 has pos 0
            rescale = torch.exp(run_max - new_max)  # [Hkv, G, 1]; 0 on the first block
            weights = torch.exp(scores - new_max)  # [Hkv, G, n]
            run_sum = run_sum * rescale + weights.sum(dim=-1, keepdim=True)
            acc = acc * rescale + torch.bmm(weights, values)  # [Hkv, G, Dv]
            run_max = new_max
        return (acc / run_sum).reshape(kv_heads * group, value_dim)
