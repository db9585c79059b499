"""The `nvidia_sm100` backend's hooks.

May import: torch and deepinfer_core at module import. CUDA APIs (torch.cuda) are touched only inside
hooks; triton is located with find_spec by the probe and imported only by kernels, once selected.
Kernels (ops, KV layout, attention) are not implemented yet, so the registry reports this backend as
unavailable for that reason even on a GPU machine.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from deepinfer_core.backend import API_VERSION, OP_NAMES, BackendInfo, Capabilities, DeviceFacts, ProbeResult, hookimpl
from deepinfer_core.kv.layout import CacheKind

DEEPINFER_API_VERSION = API_VERSION
MIN_COMPUTE_CAPABILITY = (9, 0)  # SM90 (Hopper); SM100-only paths are gated separately

_NOT_YET = "kernels are not implemented yet in this release of deepinfer-nvidia-sm100"


@hookimpl
def deepinfer_backend_info():
    return BackendInfo(
        name="nvidia_sm100",
        description="NVIDIA GPUs, SM100 tuned with SM90 paths: Triton/CUDA kernels, NCCL",
        device_kind="gpu",
        priority=100,
        aliases=("nvidia",),
    )


@hookimpl
def deepinfer_backend_capabilities():
    return Capabilities(
        dtypes=("bfloat16", "float32"),
        cache_kinds=(CacheKind.PAGED,),
        block_sizes=(128, 64),
        communicators=("in_process",),
        unsupported=tuple((op, _NOT_YET) for op in OP_NAMES),
    )


def _driver_release() -> str:
    try:
        with open("/proc/driver/nvidia/version") as f:
            words = f.readline().split()
        return next(w for w in words if w[0].isdigit() and "." in w)
    except (OSError, StopIteration):
        return "unknown"


@hookimpl
def deepinfer_backend_probe():
    if torch.version.cuda is None:
        return ProbeResult.unavailable(
            f"torch {torch.__version__} is not a CUDA build (torch.version.cuda is None); install a CUDA build of torch"
        )
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return ProbeResult.unavailable(f"no NVIDIA GPU visible{where}")
    props = torch.cuda.get_device_properties(0)
    capability = (props.major, props.minor)
    facts = dict(
        gpu=props.name,
        compute_capability=f"{props.major}.{props.minor}",
        driver=_driver_release(),
        cuda=str(torch.version.cuda),
        gpus=str(torch.cuda.device_count()),
    )
    if capability < MIN_COMPUTE_CAPABILITY:
        return ProbeResult.unavailable(
            f"{props.name} has compute capability {props.major}.{props.minor}; this backend needs 9.0 (SM90) or newer",
            **facts,
        )
    if importlib.util.find_spec("triton") is None:
        return ProbeResult.unavailable("triton is not installed: pip install 'deepinfer-nvidia-sm100[gpu]'", **facts)
    paths = "SM100 paths" if capability >= (10, 0) else "SM90 paths"
    return ProbeResult.ok(
        f"{props.name}, compute capability {facts['compute_capability']}, driver {facts['driver']}, {paths}", **facts
    )


@hookimpl
def deepinfer_backend_device(index):
    props = torch.cuda.get_device_properties(index)
    free, total = torch.cuda.mem_get_info(index)
    details = (("compute_capability", f"{props.major}.{props.minor}"), ("sms", str(props.multi_processor_count)))
    return DeviceFacts(props.name, f"cuda:{index}", total, free, details)
