"""ascend950 paged attention: one npu_fused_infer_attention_score call over the block-major cache, in the
TND layout (a ragged batch of queries) with right-down causal masking (sparse_mode 3), which is what a
chunked prefill and a decode both need. MLA passes the latent part as key and value and the rope part
through query_rope / key_rope; standard attention passes key and value slices of the entry."""

from __future__ import annotations

from types import ModuleType

import torch

from deepinfer_ascend950.kv import AscendKVLayout
from deepinfer_core.backend.ops import AttentionMetadata
from deepinfer_core.kv.layout import CacheSpec

__all__ = ["AscendAttention"]

CAUSAL_MASK_SIZE = 2048  # sparse_mode 3 takes a fixed 2048 x 2048 upper-triangular mask (True = masked)


class AscendAttention:
    def __init__(self, npu: ModuleType, layout: AscendKVLayout) -> None:
        self.npu, self.layout = npu, layout
        self._masks: dict[torch.device, torch.Tensor] = {}

    def _mask(self, device: torch.device) -> torch.Tensor:
        if device not in self._masks:
            ones = torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.bool, device=device)
            self._masks[device] = torch.triu(ones, diagonal=1)
        return self._masks[device]

    def _key_value(self, cache, spec: CacheSpec, key_dim: int, value_dim: int, value_offset: int):
        """(key, value, key_rope or None) as [blocks, block_size, Hkv * dim] tensors, and the query split."""
        parts = self.layout.parts(cache, spec)
        if len(parts) == 2 and value_offset == 0 and value_dim == spec.parts[0] and key_dim == spec.head_dim:
            return parts[0], parts[0], parts[1]  # MLA: latent is key and value, rope apart
        if len(parts) != 1:
            raise ValueError(f"no attention mapping for parts {spec.parts} with value_dim {value_dim}")
        entry = parts[0].view(*parts[0].shape[:2], spec.num_heads, spec.head_dim)
        key = entry[..., :key_dim].reshape(*entry.shape[:2], -1)
        value = entry[..., value_offset : value_offset + value_dim].reshape(*entry.shape[:2], -1)
        return key, value, None

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
        tokens, heads, key_dim = q.shape
        starts = meta.query_start_loc.tolist()  # one host read each for the op's host-side lengths
        rows = [b for b in range(meta.num_seqs) if starts[b + 1] > starts[b]]  # the op takes no empty sequence
        if not rows:
            return q.new_zeros((tokens, heads, value_dim))
        key, value, key_rope = self._key_value(cache, spec, key_dim, value_dim, value_offset)
        query, query_rope = (q[..., :value_dim], q[..., value_dim:]) if key_rope is not None else (q, None)
        seq_lens = meta.seq_lens.tolist()
        ends = [starts[b + 1] for b in rows]
        attended, _lse = self.npu.npu_fused_infer_attention_score(
            query.contiguous(),
            key,
            value,
            query_rope=None if query_rope is None else query_rope.contiguous(),
            key_rope=key_rope,
            atten_mask=self._mask(q.device),
            block_table=meta.block_tables[rows].to(torch.int32),
            actual_seq_lengths=ends,  # TND: cumulative query ends of the sequences passed
            actual_seq_lengths_kv=[seq_lens[b] for b in rows],
            num_heads=heads,
            num_key_value_heads=spec.num_heads,
            scale=scale,
            input_layout="TND",
            sparse_mode=3,
            block_size=self.layout.block_size,
        )
        return attended.view(tokens, heads, value_dim)
