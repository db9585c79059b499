"""The KV-cache layout interface: cache kinds, what a layer asks for, and the slot ids core hands out.

Core only deals in ids (blocks, sequence slots, token slots); the backend's `KVLayout` owns the physical
tensor (element order, padding, dtype) and can always export the canonical view with `gather`, so the
conformance suite can compare the caches of two backends.

Slot ids, per cache kind:
- PAGED: `block_id * block_size + offset_in_block` — one slot per token position; with
  `compress_rate` m > 1 (V4's compressed KV) a block of `block_size` tokens holds block_size / m entries,
  entry w (tokens w*m .. w*m + m - 1) at `block_id * (block_size / m) + w % (block_size / m)`.
- SLIDING_WINDOW: `seq_slot * ring_size + position % ring_size` — a per-sequence ring of
  `window + rollback_slots` token slots (production V4.1 Flash: 128 + 6).
- SEQUENCE_STATE: `seq_slot` — one fixed-shape state per sequence (e.g. V4's compressor state).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from deepinfer_core.kv.formats import BlockFormat

__all__ = ["CacheKind", "CacheSpec", "KVLayout", "compressed_slots", "paged_slots", "ring_slots"]


class CacheKind(enum.Enum):
    PAGED = "paged"
    SLIDING_WINDOW = "sliding_window"
    SEQUENCE_STATE = "sequence_state"


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """What one layer (or group of layers) needs cached; the canonical entry is [num_heads, head_dim].

    For SEQUENCE_STATE the canonical entry is `state_shape` and num_heads/head_dim are unused.
    """

    kind: CacheKind
    dtype: torch.dtype
    num_heads: int = 1
    head_dim: int = 0
    window: int = 0  # SLIDING_WINDOW: tokens attended to
    rollback_slots: int = 0  # SLIDING_WINDOW: extra slots so speculative tokens can be rolled back
    state_shape: tuple[int, ...] = ()  # SEQUENCE_STATE
    # how head_dim splits into parts a layout may store apart (MLA: (kv_lora_rank, rope dims)); () = one
    # part. The canonical entry is always the parts side by side.
    parts: tuple[int, ...] = ()
    compress_rate: int = 1  # PAGED: original tokens per entry (V4's compressed KV)
    # a block format (kv.formats.BLOCK_FORMATS) every value written is already rounded to, so a layout may
    # store the entries in it (kv.formats.pack), gather giving them back exactly; "" = none
    stored_format: str = ""

    def __post_init__(self) -> None:
        if self.kind is CacheKind.SEQUENCE_STATE:
            if not self.state_shape:
                raise ValueError("a SEQUENCE_STATE cache needs a non-empty state_shape")
        elif self.num_heads < 1 or self.head_dim < 1:
            raise ValueError(f"a {self.kind.value} cache needs num_heads >= 1 and head_dim >= 1")
        if self.kind is CacheKind.SLIDING_WINDOW and self.window < 1:
            raise ValueError("a SLIDING_WINDOW cache needs window >= 1")
        if self.compress_rate < 1 or (self.compress_rate > 1 and self.kind is not CacheKind.PAGED):
            raise ValueError(f"compress_rate {self.compress_rate}: must be >= 1, and > 1 only for PAGED caches")
        if self.parts and (sum(self.parts) != self.head_dim or min(self.parts) < 1):
            raise ValueError(f"parts {self.parts} must be positive and sum to head_dim {self.head_dim}")
        if self.stored_format:
            if self.kind is CacheKind.SEQUENCE_STATE:
                raise ValueError("a SEQUENCE_STATE cache has no stored_format")
            BlockFormat.of(self.stored_format).check_dim(self.head_dim)

    def slots_per_unit(self, block_size: int) -> int:
        """Slot ids one allocation unit holds: entries per block (PAGED), ring slots (SLIDING_WINDOW), 1 (STATE)."""
        if self.kind is CacheKind.PAGED:
            return self.entries_per_block(block_size)
        return self.ring_size if self.kind is CacheKind.SLIDING_WINDOW else 1

    @property
    def ring_size(self) -> int:
        return self.window + self.rollback_slots

    def entries_per_block(self, block_size: int) -> int:
        """PAGED: entries one block of `block_size` tokens holds."""
        if block_size % self.compress_rate:
            raise ValueError(f"block size {block_size} is not a multiple of the compress rate {self.compress_rate}")
        return block_size // self.compress_rate

    @property
    def entry_shape(self) -> tuple[int, ...]:
        if self.kind is CacheKind.SEQUENCE_STATE:
            return self.state_shape
        return (self.num_heads, self.head_dim)


@runtime_checkable
class KVLayout(Protocol):
    """The physical cache layout a backend wants. Tensors it returns live on the backend's device."""

    block_size: int  # tokens per paged block; core's block manager uses this size

    def allocate(self, spec: CacheSpec, num_units: int) -> torch.Tensor:
        """A zeroed cache for `num_units` blocks (PAGED) or sequence slots (SLIDING_WINDOW, STATE)."""
        ...

    def write(self, cache: torch.Tensor, spec: CacheSpec, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Store `values` [N, *spec.entry_shape] at distinct slot ids `slots` [N] (int64), in place."""
        ...

    def gather(self, cache: torch.Tensor, spec: CacheSpec, slots: torch.Tensor) -> torch.Tensor:
        """The canonical view: entries at `slots` [N] as a new [N, *spec.entry_shape] tensor (a copy)."""
        ...

    # Optional: `entry_bytes(spec) -> int`, the bytes one slot of `spec` takes (what core sizes the caches by);
    # without it, core counts the canonical entry, prod(spec.entry_shape) * spec.dtype.itemsize.
    # Optional: `slot_is_row = True`, a promise that slot id = row index of every cache `allocate` returns (one
    # entry a row: the canonical entry, or its packed bytes): what kernels that index caches directly check.


def paged_slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slot ids of token `positions` [N] of one sequence whose blocks are `block_table` [num_blocks]."""
    blocks = block_table[positions // block_size].to(torch.int64)  # [N]
    return blocks * block_size + positions % block_size


def ring_slots(seq_slot: int, positions: torch.Tensor, ring_size: int) -> torch.Tensor:
    """Slot ids of token `positions` [N] in the sliding-window ring of sequence slot `seq_slot`."""
    return seq_slot * ring_size + positions.to(torch.int64) % ring_size


def compressed_slots(block_table: torch.Tensor, entries: torch.Tensor, block_size: int, rate: int) -> torch.Tensor:
    """Slot ids of compressed entries `entries` [N] (entry w covers tokens w*rate ..) of one sequence."""
    per_block = block_size // rate
    blocks = block_table[entries // per_block].to(torch.int64)  # [N]
    return blocks * per_block + entries % per_block
