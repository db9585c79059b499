"""The `ascend950` backend's hooks.

May import: torch and deepinfer_core at module import. torch_npu is imported only inside the probe,
after the cheap checks (package present, CANN present, device nodes present) have passed, and by the
engine-build hooks once this backend is selected: without CANN, importing torch_npu fails and breaks
torch. The op table, layout, attention and communicator receive the torch_npu module as an argument.
This backend HAS NEVER RUN ON ASCEND HARDWARE: its calls are checked against torch_npu's op schemas and
its glue against an implementation of those ops written from the documentation, on CPU only.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os

from deepinfer_core.backend import (
    API_VERSION,
    DSPARK_OPS,
    V4_OPS,
    V41_OPS,
    BackendInfo,
    Capabilities,
    DeviceFacts,
    ProbeResult,
    hookimpl,
)
from deepinfer_core.kv.layout import CacheKind

DEEPINFER_API_VERSION = API_VERSION


_V4_NOT_YET = "not mapped to torch_npu ops yet: DeepSeek-V4 runs on the cpu reference backend for now"
_V41_NOT_YET = "DeepSeek-V4.1 op not implemented yet: DeepSeek-V4.1 runs on the cpu reference backend for now"
# V41_OPS whose reason says more than _V41_NOT_YET
_V41_REASONS = {
    "expert_row_scales": (
        "expert_ffn's routing weight before w2 is not implemented: npu_swiglu returns the activation already "
        "rounded to the compute dtype, while the weight must scale it in float32 before that rounding, and a "
        "replacement between the two npu_grouped_matmul calls cannot be run or checked without Ascend hardware; "
        "DeepSeek-V4.1 runs on the cpu reference backend for now"
    ),
}


@hookimpl
def deepinfer_backend_info():
    return BackendInfo(
        name="ascend950",
        description="Huawei Ascend NPUs (Ascend 950): torch_npu / CANN ops, HCCL",
        device_kind="npu",
        priority=100,
        aliases=("ascend",),
    )


@hookimpl
def deepinfer_backend_capabilities():
    return Capabilities(
        dtypes=("bfloat16", "float16"),
        cache_kinds=(CacheKind.PAGED,),
        block_sizes=(128,),  # Ascend's paged-attention kernels require 128-token blocks
        batch_invariant=False,  # not implemented: torch_npu's fused ops make no such promise
        communicators=("in_process", "hccl_mc2"),
        unsupported=(
            (
                "graph_capture",
                "not wired in: npu_fused_infer_attention_score takes the sequence lengths as host lists, so a "
                "captured NPU graph would need torch_npu's graph-parameter updates for them each step",
            ),
            ("sliding_window", "the V4 sliding-window ring cache is not implemented on this backend yet"),
            ("sequence_state", "per-sequence state caches are not implemented on this backend yet"),
            *((op, _V4_NOT_YET) for op in V4_OPS),
            *((op, _V41_REASONS.get(op, _V41_NOT_YET)) for op in V41_OPS),
            *((op, "DeepSeek-V4.1's DSpark draft layers are not implemented on this backend yet") for op in DSPARK_OPS),
        ),
    )


def _cann_home() -> str | None:
    for var in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"):
        if os.environ.get(var):
            return os.environ[var]
    default = "/usr/local/Ascend/ascend-toolkit/latest"
    return default if os.path.isdir(default) else None


@hookimpl
def deepinfer_backend_probe():
    if importlib.util.find_spec("torch_npu") is None:
        return ProbeResult.unavailable(
            "torch_npu is not installed (on a machine with CANN: pip install 'deepinfer-ascend950[npu]')"
        )
    cann = _cann_home()
    if cann is None:
        return ProbeResult.unavailable(
            "CANN toolkit not found: ASCEND_HOME_PATH is unset and /usr/local/Ascend is missing "
            "(source <CANN>/set_env.sh)"
        )
    if not glob.glob("/dev/davinci[0-9]*"):
        return ProbeResult.unavailable("no NPU visible: no /dev/davinci* device nodes", cann=cann)
    try:
        importlib.import_module("torch_npu")
        import torch

        count = torch.npu.device_count()
        name = torch.npu.get_device_name(0) if count else ""
    except Exception as err:  # a broken CANN install must be a reason, not a crash
        return ProbeResult.unavailable(f"torch_npu failed to initialise: {type(err).__name__}: {err}", cann=cann)
    if count == 0:
        visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "unset")
        return ProbeResult.unavailable(f"no NPU visible (ASCEND_RT_VISIBLE_DEVICES={visible})", cann=cann)
    return ProbeResult.ok(f"{name}, {count} NPU(s), CANN at {cann}", npu=name, npus=str(count), cann=cann)


def _torch_npu():
    """torch_npu, imported only once this backend has been selected (see the module docstring)."""
    return importlib.import_module("torch_npu")


@hookimpl
def deepinfer_backend_device(index):
    import torch

    _torch_npu()  # registers the NPU device with torch
    free, total = torch.npu.mem_get_info(index)
    return DeviceFacts(torch.npu.get_device_name(index), f"npu:{index}", total, free)


@hookimpl
def deepinfer_backend_ops():
    from deepinfer_ascend950.ops import AscendOps

    return AscendOps(_torch_npu())


@hookimpl
def deepinfer_backend_kv_layout(device, block_size):
    import torch

    from deepinfer_ascend950.kv import AscendKVLayout

    return AscendKVLayout(_torch_npu(), torch.device(device.torch_device), block_size or 128)


@hookimpl
def deepinfer_backend_attention(layout):
    from deepinfer_ascend950.attention import AscendAttention

    return AscendAttention(_torch_npu(), layout)


@hookimpl
def deepinfer_backend_communicator(world_size, rank):
    """In-process for one rank; otherwise the fused MC2 dispatch/combine over the default group's HCCL
    communicator (the launcher has called torch.distributed.init_process_group(backend="hccl"))."""
    if world_size == 1:
        from deepinfer_core.parallel.communicator import InProcessCommunicator

        return InProcessCommunicator()
    import torch
    import torch.distributed as dist

    from deepinfer_ascend950.communicator import McDistributeCommunicator

    group = dist.group.WORLD
    name = group._get_backend(torch.device("npu")).get_hccl_comm_name(rank)
    return McDistributeCommunicator(_torch_npu(), name, world_size, rank)
