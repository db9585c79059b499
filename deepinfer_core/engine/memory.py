"""The KV-cache budget from `gpu_memory_utilization` (vLLM's meaning): the share of the device's memory this
engine may use for weights and KV cache, less what the loaded weights take; and the blocks a budget holds."""

from __future__ import annotations

import torch

from deepinfer_core.backend.resolve import ResolvedBackend
from deepinfer_core.backend.types import DeviceFacts
from deepinfer_core.errors import DeepInferError
from deepinfer_core.kv.caches import LayerSpecs, block_bytes, sequence_bytes
from deepinfer_core.kv.layout import KVLayout

__all__ = ["blocks_for_memory", "check_utilization", "kv_budget_from_utilization", "model_bytes"]

_GIB = 1 << 30
_LEAVES = (str, bytes, int, float, bool, complex, type(None), type)


def check_utilization(fraction: float | None) -> None:
    if fraction is not None and not 0 < fraction <= 1:
        raise DeepInferError(
            f"gpu_memory_utilization must be in (0, 1] (--gpu-memory-utilization: the share of the device's "
            f"memory for weights and KV cache), got {fraction}"
        )


def model_bytes(model, device: torch.device | None = None) -> int:
    """Bytes held by the model's tensors (weights, tables) on `device`'s type (default: anywhere), each
    storage counted once.

    Walks the model object's attributes, containers and deepinfer objects; the backend is not the model's.
    """
    storages: dict[tuple[str, int], int] = {}
    seen: set[int] = set()
    stack = [model]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (*_LEAVES, ResolvedBackend)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if device is not None and obj.device.type != device.type:  # one device of each type per model
                continue
            storage = obj.untyped_storage()
            storages[(str(obj.device), storage.data_ptr())] = storage.nbytes()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple | set | frozenset):
            stack.extend(obj)
        elif type(obj).__module__.startswith("deepinfer"):
            stack.extend(vars(obj).values() if hasattr(obj, "__dict__") else ())
            for cls in type(obj).__mro__:
                slots = getattr(cls, "__slots__", ())
                names = (slots,) if isinstance(slots, str) else slots
                stack.extend(getattr(obj, name) for name in names if hasattr(obj, name))
    return sum(storages.values())


def kv_budget_from_utilization(fraction: float, device: DeviceFacts, weights: int) -> int:
    """fraction * the device's total memory - the weights' bytes; an error when nothing is left."""
    if device.total_memory_bytes <= 0:
        raise DeepInferError(
            f"gpu_memory_utilization needs the device's memory size, but {device.name} does not report it; "
            "size the KV cache with kv_cache_memory_bytes (or num_kv_blocks) instead"
        )
    allowed = int(fraction * device.total_memory_bytes)
    budget = allowed - weights
    if budget <= 0:
        raise DeepInferError(
            f"gpu_memory_utilization {fraction} allows {allowed / _GIB:.2f} GiB of {device.name}'s "
            f"{device.total_memory_bytes / _GIB:.2f} GiB, but the weights alone take {weights / _GIB:.2f} GiB, "
            "leaving nothing for the KV cache; raise gpu_memory_utilization"
        )
    return budget


def blocks_for_memory(
    specs: LayerSpecs, layout: KVLayout, memory_bytes: int, *, num_seqs: int, max_model_len: int
) -> int:
    """Blocks that fit in `memory_bytes` once every one of `num_seqs` sequence slots' per-sequence caches is
    set aside, with entries as `layout` stores them.

    A model without paged caches (a DeepSeek-V4 whose layers are all sliding-window) stores nothing per
    block: its blocks only count tokens, and it gets enough for every sequence slot to reach max_model_len.
    """
    block_size = layout.block_size
    per_sequence = sequence_bytes(specs, layout) * num_seqs
    per_block = block_bytes(specs, block_size, layout)
    if per_block == 0:
        blocks = num_seqs * -(-max_model_len // block_size) if per_sequence <= memory_bytes else 0
    else:
        blocks = (memory_bytes - per_sequence) // per_block
    if blocks < 1:
        raise DeepInferError(
            f"the KV cache budget of {memory_bytes / 2**20:.0f} MiB does not fit the per-sequence caches of "
            f"{num_seqs} sequences ({per_sequence / 2**20:.0f} MiB) plus one block: raise kv_cache_memory_bytes "
            "or lower max_num_seqs"
        )
    return blocks
