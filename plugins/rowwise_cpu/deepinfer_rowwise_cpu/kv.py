"""rowwise_cpu's physical KV-cache layout (deepinfer_core.kv.layout.KVLayout), head-major within a block;
imports only torch and deepinfer_core.kv.layout.

PAGED:          [num_blocks, num_heads, block_size, head_dim]  slot = block * block_size + offset
  compressed:   [num_blocks, num_heads, block_size / m, head_dim] (compress_rate m) slot = block * (block_size / m) + w
SLIDING_WINDOW: [seqs, num_heads, ring_size, head_dim]         slot = seq * ring_size + position % ring_size
SEQUENCE_STATE: [seqs, *state_shape]                           slot = seq
`gather` translates back to the canonical [N, *entry_shape] view.
"""

from __future__ import annotations

import torch

from deepinfer_core.kv.layout import CacheKind, CacheSpec

__all__ = ["HeadMajorKVLayout"]


class HeadMajorKVLayout:
    """Each unit (block or ring) keeps one head's tokens contiguous: unit[h] is [tokens, head_dim]."""

    def __init__(self, device: torch.device, block_size: int = 64) -> None:
        self.device = device
        self.block_size = block_size

    def _unit_tokens(self, spec: CacheSpec) -> int:
        """Token slots per unit: a block (PAGED) or a ring (SLIDING_WINDOW)."""
        return spec.entries_per_block(self.block_size) if spec.kind is CacheKind.PAGED else spec.ring_size

    def allocate(self, spec: CacheSpec, num_units: int) -> torch.Tensor:
        if spec.kind is CacheKind.SEQUENCE_STATE:
            shape = (num_units, *spec.state_shape)
        else:
            shape = (num_units, spec.num_heads, self._unit_tokens(spec), spec.head_dim)
        return torch.zeros(shape, dtype=spec.dtype, device=self.device)

    def _locate(self, spec: CacheSpec, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slot ids [N] -> (unit index [N], token offset in the unit [N])."""
        slots = slots.to(device=self.device, dtype=torch.int64)
        unit = self._unit_tokens(spec)
        return slots // unit, slots % unit

    def write(self, cache: torch.Tensor, spec: CacheSpec, slots: torch.Tensor, values: torch.Tensor) -> None:
        values = values.to(cache.dtype)  # [N, *entry_shape]
        if spec.kind is CacheKind.SEQUENCE_STATE:
            cache[slots.to(torch.int64)] = values
            return
        units, offsets = self._locate(spec, slots)
        cache[units, :, offsets] = values  # indexed view is [N, H, D]: the index dims come first

    def gather(self, cache: torch.Tensor, spec: CacheSpec, slots: torch.Tensor) -> torch.Tensor:
        if spec.kind is CacheKind.SEQUENCE_STATE:
            return cache[slots.to(torch.int64)]  # [N, *state_shape]
        units, offsets = self._locate(spec, slots)
        return cache[units, :, offsets]  # [N, H, D]

    def block(self, cache: torch.Tensor, block_id: int, num_tokens: int) -> torch.Tensor:
        """The first `num_tokens` entries of paged block `block_id`, head-major: a view [H, num_tokens, D]. In a
        compressed cache (compress_rate m) a block holds block_size / m entries: w % (block_size / m) is here."""
        return cache[block_id, :, :num_tokens]

    def ring(self, cache: torch.Tensor, seq_slot: int) -> torch.Tensor:
        """Sequence slot `seq_slot`'s sliding-window ring, head-major: a view [H, ring_size, D] holding
        position p at [:, p % ring_size]."""
        return cache[seq_slot]
