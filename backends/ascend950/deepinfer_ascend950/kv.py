"""The ascend950 paged KV layout: per part of an entry (MLA: latent | rope, CacheSpec.parts) a contiguous
[num_blocks, block_size, Hkv * part] tensor, the block-major layout torch_npu's paged attention reads
(key, value and key_rope each its own tensor), all carved from one allocation per layer."""

from __future__ import annotations

from types import ModuleType

import torch

from deepinfer_core.kv.layout import CacheKind, CacheSpec

__all__ = ["AscendKVLayout"]


class AscendKVLayout:
    """Slot id = block * block_size + offset (core's paged slots); writes go through npu_scatter_nd_update_."""

    def __init__(self, npu: ModuleType, device: torch.device, block_size: int = 128) -> None:
        self.npu, self.device, self.block_size = npu, device, block_size
        self._blocks: dict[int, int] = {}  # id(cache) -> its number of blocks

    @staticmethod
    def _parts(spec: CacheSpec) -> tuple[int, ...]:
        return spec.parts or (spec.head_dim,)

    def allocate(self, spec: CacheSpec, num_units: int) -> torch.Tensor:
        if spec.kind is not CacheKind.PAGED:
            raise ValueError(f"ascend950 stores only paged caches, not {spec.kind.value}")
        size = num_units * self.block_size * spec.num_heads * spec.head_dim
        cache = torch.zeros(size, dtype=spec.dtype, device=self.device)  # parts one after another
        self._blocks[id(cache)] = num_units
        return cache

    def parts(self, cache: torch.Tensor, spec: CacheSpec) -> list[torch.Tensor]:
        """The part views [num_blocks, block_size, Hkv * part], each contiguous."""
        blocks = cache.numel() // (self.block_size * spec.num_heads * spec.head_dim)
        views, start = [], 0
        for part in self._parts(spec):
            length = blocks * self.block_size * spec.num_heads * part
            views.append(cache[start : start + length].view(blocks, self.block_size, spec.num_heads * part))
            start += length
        return views

    def write(self, cache: torch.Tensor, spec: CacheSpec, slots: torch.Tensor, values: torch.Tensor) -> None:
        """values [N, Hkv, Dc] -> each part's rows at `slots` (one scatter per part)."""
        indices = slots.to(torch.int64)[:, None]  # [N, 1]: one index per row of the flattened part
        start = 0
        for view, part in zip(self.parts(cache, spec), self._parts(spec)):
            rows = view.view(-1, view.shape[-1])  # [blocks * block_size, Hkv * part]
            piece = values[..., start : start + part].reshape(values.shape[0], -1).to(cache.dtype)
            self.npu.npu_scatter_nd_update_(rows, indices, piece)
            start += part

    def gather(self, cache: torch.Tensor, spec: CacheSpec, slots: torch.Tensor) -> torch.Tensor:
        pieces = [
            view.view(-1, spec.num_heads, part)[slots] for view, part in zip(self.parts(cache, spec), self._parts(spec))
        ]
        return torch.cat(pieces, dim=-1)  # [N, Hkv, Dc], the canonical entry
