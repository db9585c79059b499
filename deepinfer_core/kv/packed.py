"""A row-per-slot KV layout that stores caches with a `stored_format` packed in that format (kv.formats):
DeepSeek-V4.1's window KV in FP8 (a byte per value and one per 32), its compressed entries and indexer keys in
FP4 (half a byte per value and one per 16 or 32): about 1/2, 1/3.6 and 1/3.8 of their bfloat16 bytes.

Vendor-neutral torch, so any backend may return it from `deepinfer_backend_kv_layout`; its kernels then read
the packed rows themselves (the byte layout is kv.formats'). Caches without a stored_format are as the
reference layout's: one row [*entry_shape] of the spec's dtype per slot.
"""

from __future__ import annotations

import math

import torch

from deepinfer_core.kv.formats import BlockFormat, pack, unpack
from deepinfer_core.kv.layout import CacheSpec

__all__ = ["PackedKVLayout"]


class PackedKVLayout:
    """Slot id = row index. A cache with a stored_format is [rows, row_bytes] uint8 (each row the packed
    entry, its heads side by side); any other is [rows, *entry_shape] of its dtype."""

    slot_is_row = True

    def __init__(self, device: torch.device, block_size: int = 128) -> None:
        self.device = device
        self.block_size = block_size

    def entry_bytes(self, spec: CacheSpec) -> int:
        dim = math.prod(spec.entry_shape)
        if spec.stored_format:
            return BlockFormat.of(spec.stored_format).row_bytes(dim)
        return dim * spec.dtype.itemsize

    def allocate(self, spec: CacheSpec, num_units: int) -> torch.Tensor:
        rows = num_units * spec.slots_per_unit(self.block_size)
        if spec.stored_format:
            return torch.zeros((rows, self.entry_bytes(spec)), dtype=torch.uint8, device=self.device)
        return torch.zeros((rows, *spec.entry_shape), dtype=spec.dtype, device=self.device)

    def write(self, cache: torch.Tensor, spec: CacheSpec, slots: torch.Tensor, values: torch.Tensor) -> None:
        if spec.stored_format:
            cache[slots] = pack(values.flatten(1), spec.stored_format)  # flatten: N may be 0
        else:
            cache[slots] = values.to(cache.dtype)

    def gather(self, cache: torch.Tensor, spec: CacheSpec, slots: torch.Tensor) -> torch.Tensor:
        if spec.stored_format:
            return unpack(cache[slots], spec.stored_format, spec.dtype).view(-1, *spec.entry_shape)
        return cache[slots]
