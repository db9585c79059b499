"""Reference KV layout: the canonical layout itself, one row per slot."""

from __future__ import annotations

import torch

from deepinfer_core.kv.layout import CacheKind, CacheSpec

__all__ = ["ReferenceKVLayout"]


class ReferenceKVLayout:
    """PAGED: [num_blocks * entries per block, H, D]; SLIDING_WINDOW: [seqs * ring_size, H, D];
    SEQUENCE_STATE: [seqs, *state_shape]. Slot id = row index, so gather is plain indexing."""

    def __init__(self, device: torch.device, block_size: int = 128) -> None:
        self.device = device
        self.block_size = block_size

    def _rows(self, spec: CacheSpec, num_units: int) -> int:
        if spec.kind is CacheKind.PAGED:
            return num_units * spec.entries_per_block(self.block_size)
        if spec.kind is CacheKind.SLIDING_WINDOW:
            return num_units * spec.ring_size
        return num_units

    def allocate(self, spec: CacheSpec, num_units: int) -> torch.Tensor:
        return torch.zeros((self._rows(spec, num_units), *spec.entry_shape), dtype=spec.dtype, device=self.device)

    def write(self, cache: torch.Tensor, spec: CacheSpec, slots: torch.Tensor, values: torch.Tensor) -> None:
        cache[slots] = values.to(cache.dtype)

    def gather(self, cache: torch.Tensor, spec: CacheSpec, slots: torch.Tensor) -> torch.Tensor:
        return cache[slots]
