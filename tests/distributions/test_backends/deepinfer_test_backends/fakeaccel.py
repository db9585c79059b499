"""An available backend with a higher priority than cpu, reusing reference kernels; hooks take argument subsets."""

import torch

from deepinfer_core.backend import API_VERSION, BackendInfo, Capabilities, DeviceFacts, ProbeResult, hookimpl
from deepinfer_core.kv.layout import CacheKind
from deepinfer_core.reference.attention import ReferenceAttention
from deepinfer_core.reference.kv import ReferenceKVLayout
from deepinfer_core.reference.ops import ReferenceOps

DEEPINFER_API_VERSION = API_VERSION


@hookimpl
def deepinfer_backend_info():
    return BackendInfo("fakeaccel", "test accelerator", "cpu", priority=60, aliases=("fake",))


@hookimpl
def deepinfer_backend_capabilities():
    return Capabilities(
        dtypes=("float32",),
        cache_kinds=(CacheKind.PAGED,),
        block_sizes=(64,),
        unsupported=(("expert_ffn", "no grouped GEMM on the fake device"),),
    )


@hookimpl
def deepinfer_backend_probe():
    return ProbeResult.ok("fake device present", devices="1")


@hookimpl
def deepinfer_backend_device():
    return DeviceFacts("fake0", "cpu", 1 << 30, 1 << 30)


@hookimpl
def deepinfer_backend_ops():
    return ReferenceOps()


@hookimpl
def deepinfer_backend_kv_layout():
    return ReferenceKVLayout(torch.device("cpu"), block_size=64)


@hookimpl
def deepinfer_backend_attention(layout):
    return ReferenceAttention(layout)
