"""The `cpu` backend's hooks: the reference implementation of the whole contract, plain PyTorch on CPU.

Imports only torch and core. It is the oracle of the conformance suite, so obvious beats fast.
"""

from __future__ import annotations

import os

import torch

from deepinfer_core.backend.hookspecs import API_VERSION, hookimpl
from deepinfer_core.backend.types import BackendInfo, Capabilities, DeviceFacts, ProbeResult
from deepinfer_core.kv.layout import CacheKind
from deepinfer_core.reference.attention import ReferenceAttention
from deepinfer_core.reference.kv import ReferenceKVLayout
from deepinfer_core.reference.ops import ReferenceOps

DEEPINFER_API_VERSION = API_VERSION


@hookimpl
def deepinfer_backend_info():
    return BackendInfo(
        name="cpu",
        description="reference backend: plain PyTorch on CPU, the executable spec",
        device_kind="cpu",
        priority=0,
    )


@hookimpl
def deepinfer_backend_capabilities():
    return Capabilities(
        dtypes=("float32", "bfloat16"),
        cache_kinds=tuple(CacheKind),
        block_sizes=(128, 64, 32, 16),
        batch_invariant=False,  # torch's CPU GEMMs may block differently by batch size
        deterministic_sampling=True,
        communicators=("in_process", "torch_distributed:gloo"),
        unsupported=(("graph_capture", "the reference backend runs eagerly"),),
    )


@hookimpl
def deepinfer_backend_probe():
    return ProbeResult.ok(f"torch {torch.__version__}, {os.cpu_count()} CPU threads")


def _memory_bytes() -> tuple[int, int]:
    """(total, available) system memory, from /proc/meminfo where it exists."""
    try:
        with open("/proc/meminfo") as f:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return fields["MemTotal"], fields.get("MemAvailable", fields["MemFree"])
    except (OSError, KeyError, ValueError):
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return pages, pages


@hookimpl
def deepinfer_backend_device(index):
    if index < 0:  # every rank of a data-parallel world shares the host: any index is the host
        raise ValueError(f"the cpu backend's device index must be 0 or more, not {index}")
    total, free = _memory_bytes()
    return DeviceFacts("cpu", "cpu", total, free, (("threads", str(torch.get_num_threads())),))


@hookimpl
def deepinfer_backend_ops():
    return ReferenceOps()


@hookimpl
def deepinfer_backend_kv_layout(device, block_size):
    return ReferenceKVLayout(torch.device(device.torch_device), block_size or 128)


@hookimpl
def deepinfer_backend_attention(layout):
    return ReferenceAttention(layout)
