"""Reference KV layout: the canonical layout itself, one row per slot."""

from __future__ import annotations

import torch

from deepinfer_core.kv.layout import CacheSpec

__all__ = ["ReferenceKVLayout"]


class ReferenceKVLayout:
    """PAGED: [num_blocks * entries per block, H, D]; SLIDING_WINDOW: [seqs * ring_size, H, D];
    SEQUENCE_STATE: [seqs, *state_shape]. Slot id = row index, so gather is plain indexing."""

    slot_is_row = True

    def __init__(self, device: torch.device, block_size: int = 128) -> None:
        self.device = device
        self.block_size = block_size

    def allocate(self, spec: CacheSpec, num_units: int) -> torch.Tensor:
        rows = num_units * spec.slots_per_unit(self.block_size)
        return torch.zeros((rows, *spec.entry_shape), dtype=spec.dtype, device=self.device)

    def write(self, cache: torch.Tensor, spec: CacheSpec, slots: torch.Tensor, values: torch.Tensor) -> None:
        cache[slots] = values.to(cache.dtype)

    def gather(self, cache: torch.Tensor, spec: CacheSpec, slots: torch.Tensor) -> torch.Tensor:
        return cache[slots]
