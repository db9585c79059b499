"""Frozen data a backend reports about itself: identity, capabilities, probe result, device facts."""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer_core.kv.layout import CacheKind

__all__ = ["BackendInfo", "Capabilities", "DeviceFacts", "ProbeResult"]


@dataclass(frozen=True, slots=True)
class BackendInfo:
    """Who a backend is. `name` must equal its entry-point name in `deepinfer.backends`."""

    name: str
    description: str
    device_kind: str  # generic word for the hardware class: "cpu", "gpu", "npu", ...
    priority: int = 50  # `auto` picks the available backend with the highest priority; cpu is 0
    aliases: tuple[str, ...] = ()  # short names accepted by DEEPINFER_ACCELERATOR, e.g. ("nvidia",)


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend can do, as data. Anything it cannot do is listed in `unsupported` with a reason."""

    dtypes: tuple[str, ...]  # compute dtypes by torch name: "float32", "bfloat16", ...
    cache_kinds: tuple[CacheKind, ...]
    block_sizes: tuple[int, ...] = (128,)  # paged-KV block sizes it accepts; the first is preferred
    kv_dtypes: tuple[str, ...] = ()  # KV-cache storage dtypes; empty means "the compute dtypes"
    # block formats (kv.formats.BLOCK_FORMATS) its KV layout stores a cache in, bytes and all, where the cache's
    # CacheSpec names one as stored_format (the others it stores as canonical entries of the spec's dtype)
    kv_formats: tuple[str, ...] = ()
    # a request's logits are bitwise the same whatever else is in the batch, its position in it, and
    # however its prompt was split into prefill chunks (the conformance suite checks all three)
    batch_invariant: bool = False
    deterministic_sampling: bool = True  # counter-based seeded noise, identical to core's definition
    graph_capture: bool = False  # decode steps can be captured and replayed as a device graph
    async_scheduling: bool = False  # the engine may plan step N+1 while the device runs step N
    communicators: tuple[str, ...] = ("in_process",)  # expert-parallel transports it provides
    # weight storage formats `linear` / `expert_ffn` take as they are: "fp8_block" (ops.BlockFP8, float32 or
    # E8M0 scales, any block), "mxfp4" (ops.MXFP4, expert_ffn only); others are dequantized at load
    weight_formats: tuple[str, ...] = ()
    unsupported: tuple[tuple[str, str], ...] = ()  # (op or feature name, reason)

    def supports(self, op: str) -> bool | str:
        """True when `op` (an op-table method or feature name) is supported, else the reason."""
        for name, reason in self.unsupported:
            if name == op:
                return reason
        return True

    def as_dict(self) -> dict:
        return {
            "dtypes": list(self.dtypes),
            "cache_kinds": [kind.value for kind in self.cache_kinds],
            "block_sizes": list(self.block_sizes),
            "kv_dtypes": list(self.kv_dtypes or self.dtypes),
            "kv_formats": list(self.kv_formats),
            "batch_invariant": self.batch_invariant,
            "deterministic_sampling": self.deterministic_sampling,
            "graph_capture": self.graph_capture,
            "async_scheduling": self.async_scheduling,
            "communicators": list(self.communicators),
            "weight_formats": list(self.weight_formats),
            "unsupported": {name: reason for name, reason in self.unsupported},
        }


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """Whether the backend can run on this machine now; `reason` says why not (or what was found)."""

    available: bool
    reason: str = ""
    facts: tuple[tuple[str, str], ...] = ()  # e.g. (("gpu", "NVIDIA H200"), ("driver", "580.1"))

    @classmethod
    def ok(cls, reason: str = "", **facts: str) -> ProbeResult:
        return cls(True, reason, tuple(facts.items()))

    @classmethod
    def unavailable(cls, reason: str, **facts: str) -> ProbeResult:
        return cls(False, reason, tuple(facts.items()))


@dataclass(frozen=True, slots=True)
class DeviceFacts:
    """One device as the backend sees it; `torch_device` is what tensors are placed on."""

    name: str
    torch_device: str  # e.g. "cpu"; core passes it to torch.device and never interprets it
    total_memory_bytes: int
    free_memory_bytes: int
    details: tuple[tuple[str, str], ...] = field(default=())
