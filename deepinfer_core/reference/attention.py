"""Reference paged attention: one sequence at a time, gather the context, softmax in float32."""

from __future__ import annotations

import torch

from deepinfer_core.backend.ops import AttentionMetadata
from deepinfer_core.kv.layout import CacheSpec, KVLayout, paged_slots

__all__ = ["ReferenceAttention"]


class ReferenceAttention:
    """Implements AttentionOps over any KVLayout by reading the canonical view through `gather`."""

    def __init__(self, layout: KVLayout) -> None:
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
        num_heads, key_dim = q.shape[1], q.shape[2]
        group = num_heads // spec.num_heads  # query heads per cached head
        out = q.new_empty((q.shape[0], num_heads, value_dim))
        starts = meta.query_start_loc.tolist()
        for b, seq_len in enumerate(meta.seq_lens.tolist()):
            q_start, q_end = starts[b], starts[b + 1]
            if q_end == q_start:
                continue
            positions = torch.arange(seq_len, device=q.device)
            slots = paged_slots(meta.block_tables[b], positions, self.layout.block_size)
            entries = self.layout.gather(cache, spec, slots).float()  # [S, Hkv, Dc]
            keys = entries[..., :key_dim]
            values = entries[..., value_offset : value_offset + value_dim]
            queries = q[q_start:q_end].float().unflatten(1, (spec.num_heads, group))  # [Q, Hkv, G, Dk]
            scores = torch.einsum("qkgd,skd->kgqs", queries, keys) * scale  # [Hkv, G, Q, S]
            q_pos = torch.arange(seq_len - (q_end - q_start), seq_len, device=q.device)  # [Q]
            scores = scores.masked_fill(positions[None, :] > q_pos[:, None], float("-inf"))
            attended = torch.einsum("kgqs,skd->qkgd", scores.softmax(dim=-1), values)  # [Q, Hkv, G, Dv]
            out[q_start:q_end] = attended.flatten(1, 2).to(q.dtype)
        return out
