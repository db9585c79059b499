"""A model's caches as data: per layer, named CacheSpecs; allocation and sizing over any KVLayout.

A model lists what each layer caches (`model.cache_specs`: one dict name -> CacheSpec per layer). PAGED
caches grow with the tokens (one unit per block of `block_size` tokens, fewer entries per block when
compressed); SLIDING_WINDOW and SEQUENCE_STATE caches have one unit per sequence slot.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from deepinfer_core.kv.layout import CacheKind, CacheSpec, KVLayout

__all__ = ["LayerSpecs", "allocate_caches", "block_bytes", "sequence_bytes"]

LayerSpecs = Sequence[dict[str, CacheSpec]]


def _entry_bytes(spec: CacheSpec, layout: KVLayout | None) -> int:
    """The layout's `entry_bytes` (KVLayout's optional method), else the canonical entry's bytes."""
    if layout is not None and hasattr(layout, "entry_bytes"):
        return layout.entry_bytes(spec)
    return math.prod(spec.entry_shape) * spec.dtype.itemsize


def block_bytes(specs: LayerSpecs, block_size: int, layout: KVLayout | None = None) -> int:
    """Bytes one paged block (of block_size tokens) takes across every layer's PAGED caches, as `layout`
    stores them (None: canonical entries)."""
    return sum(
        spec.entries_per_block(block_size) * _entry_bytes(spec, layout)
        for layer in specs
        for spec in layer.values()
        if spec.kind is CacheKind.PAGED
    )


def sequence_bytes(specs: LayerSpecs, layout: KVLayout | None = None) -> int:
    """Bytes one sequence slot takes across every layer's per-sequence caches, as `layout` stores them."""
    return sum(
        (spec.ring_size if spec.kind is CacheKind.SLIDING_WINDOW else 1) * _entry_bytes(spec, layout)
        for layer in specs
        for spec in layer.values()
        if spec.kind is not CacheKind.PAGED
    )


def allocate_caches(
    layout: KVLayout, specs: LayerSpecs, num_blocks: int, num_seq_slots: int
) -> list[dict[str, torch.Tensor]]:
    """Zeroed caches, per layer name -> tensor: PAGED ones with `num_blocks` blocks, the others with
    `num_seq_slots` sequence slots."""
    return [
        {
            name: layout.allocate(spec, num_blocks if spec.kind is CacheKind.PAGED else num_seq_slots)
            for name, spec in layer.items()
        }
        for layer in specs
    ]
