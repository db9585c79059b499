"""The `rowwise_cpu` backend's hooks (entry point `deepinfer.backends: rowwise_cpu`); imports only torch, the
contract of deepinfer_core.backend and this package.

An example of a third-party backend written from scratch: its own op kernels, KV layout, attention and
sampler, all processing one token row at a time so that results never depend on the batch. It implements
every op of the contract, DeepSeek-V4's (V4_OPS) and DeepSeek-V4.1's (V41_OPS) included, so it can run V3,
V4 and V4.1 models.
"""

from __future__ import annotations

import torch

from deepinfer_core.backend import API_VERSION, BackendInfo, Capabilities, DeviceFacts, ProbeResult, hookimpl
from deepinfer_core.kv.layout import CacheKind
from deepinfer_rowwise_cpu.attention import OnlineSoftmaxAttention
from deepinfer_rowwise_cpu.cost import RowwiseCostModel
from deepinfer_rowwise_cpu.kernels import RowwiseOps
from deepinfer_rowwise_cpu.kv import HeadMajorKVLayout
from deepinfer_rowwise_cpu.sampler import RowwiseSampler

DEEPINFER_API_VERSION = API_VERSION

BLOCK_SIZES = (64, 128, 16)  # the first is preferred


@hookimpl
def deepinfer_backend_info():
    return BackendInfo(
        name="rowwise_cpu",
        description=(
            "example third-party backend: CPU kernels that process one token row at a time, "
            "batch-invariant by construction"
        ),
        device_kind="cpu",
        priority=-10,  # below the reference `cpu` (0): `auto` never prefers it; select it by name
    )


@hookimpl
def deepinfer_backend_capabilities():
    return Capabilities(
        dtypes=("float32", "bfloat16"),
        cache_kinds=tuple(CacheKind),
        block_sizes=BLOCK_SIZES,
        batch_invariant=True,
        deterministic_sampling=True,
        communicators=("in_process", "torch_distributed:gloo"),
        # every op of OP_NAMES is supported, V4_OPS and V41_OPS included (RowwiseOps / OnlineSoftmaxAttention)
        unsupported=(("graph_capture", "rowwise_cpu runs eagerly, one Python loop iteration per token row"),),
    )


@hookimpl
def deepinfer_backend_probe():
    return ProbeResult.ok(f"torch {torch.__version__} on CPU")


def _meminfo_bytes() -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes from /proc/meminfo; (0, 0) where it cannot be read."""
    found: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    found[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        return 0, 0
    total = found.get("MemTotal", 0)
    return total, found.get("MemAvailable", found.get("MemFree", total))


@hookimpl
def deepinfer_backend_device(index):
    if index < 0:  # every rank of a data-parallel world shares the host: any index is the host
        raise ValueError(f"rowwise_cpu's device index must be 0 or more, not {index}")
    total, free = _meminfo_bytes()
    return DeviceFacts("cpu (rowwise)", "cpu", total, free, (("threads", str(torch.get_num_threads())),))


@hookimpl
def deepinfer_backend_ops():
    return RowwiseOps()


@hookimpl
def deepinfer_backend_kv_layout(device, block_size):
    return HeadMajorKVLayout(torch.device(device.torch_device), block_size or BLOCK_SIZES[0])


@hookimpl
def deepinfer_backend_attention(layout):
    return OnlineSoftmaxAttention(layout)


@hookimpl
def deepinfer_backend_sampler():
    return RowwiseSampler()


@hookimpl
def deepinfer_backend_cost_model():
    return RowwiseCostModel()
