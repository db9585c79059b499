"""The `nvidia_sm100` backend's hooks.

May import: torch and deepinfer_core at module import. CUDA APIs (torch.cuda) are touched only inside
hooks; triton is located with find_spec by the probe and imported (with the kernels) only by the
engine-build hooks, once this backend is selected.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from deepinfer_core.backend import API_VERSION, BackendInfo, Capabilities, DeviceFacts, ProbeResult, hookimpl
from deepinfer_core.kv.formats import BLOCK_FORMATS
from deepinfer_core.kv.layout import CacheKind

DEEPINFER_API_VERSION = API_VERSION
MIN_COMPUTE_CAPABILITY = (9, 0)  # SM90 (Hopper); SM100-only paths are gated separately


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
        # PAGED (compressed too), SLIDING_WINDOW, SEQUENCE_STATE: PackedKVLayout's row-per-slot caches
        cache_kinds=(CacheKind.PAGED, CacheKind.SLIDING_WINDOW, CacheKind.SEQUENCE_STATE),
        # DeepSeek-V4.1's window KV in FP8, compressed entries and indexer keys in FP4, as packed bytes that the
        # attention and indexer kernels decode in registers (kernels.packed)
        kv_formats=BLOCK_FORMATS,
        block_sizes=(128, 64, 32, 16),
        # on request: fixed-tiling Triton GEMMs replace cuBLAS (ops.NvidiaOps); every other op is row-local, V4's
        # and V4.1's included (the conformance suite's bitwise cases run a tiny V4 as well as a tiny V3)
        batch_invariant=True,
        deterministic_sampling=True,
        graph_capture=True,  # decode steps (DeepSeek-V4.1's not with host-placed engram tables)
        async_scheduling=True,
        # expert parallelism: core's AllToAllCommunicator over NCCL (torch.distributed's all_to_all_single)
        communicators=("in_process", "torch_distributed:nccl"),
        # DeepSeek's FP8 weights and FP4 experts stay so in memory (1/2 and ~1/4 of bf16's bytes to read), dequantized
        # tile by tile in the GEMMs' registers (kernels.quant)
        weight_formats=("fp8_block", "mxfp4"),
        # V4_OPS and V41_OPS are all Triton kernels: V4.1's hyper-connection, rounding and engram ops are
        # kernels.hyper, kernels.rounding and kernels.engram, expert_row_scales is fused into the grouped expert
        # GEMM (kernels.moe), indexer_topk / indexer_select are kernels.indexer; DSPARK_OPS' block_attention is a Triton
        # kernel (kernels.block_attention)
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


@hookimpl
def deepinfer_backend_ops(batch_invariant):
    from deepinfer_nvidia_sm100.ops import NvidiaOps

    return NvidiaOps(batch_invariant=batch_invariant)


@hookimpl
def deepinfer_backend_kv_layout(device, block_size):
    from deepinfer_nvidia_sm100.kv import NvidiaKVLayout  # row per slot, V4.1's KV packed: what the kernels read

    return NvidiaKVLayout(torch.device(device.torch_device), block_size or 128)


@hookimpl
def deepinfer_backend_attention(layout, batch_invariant):
    from deepinfer_nvidia_sm100.ops import NvidiaAttention

    # the layout: V4's attention ops read rings and compressed caches through it
    return NvidiaAttention(layout, batch_invariant)


@hookimpl
def deepinfer_backend_graph_capture(device):
    from deepinfer_nvidia_sm100.graphs import CudaGraphCapture

    return CudaGraphCapture(torch.device(device.torch_device))


@hookimpl
def deepinfer_backend_step_timer(device):
    from deepinfer_nvidia_sm100.timing import CudaEventStepTimer

    return CudaEventStepTimer(torch.device(device.torch_device))


@hookimpl
def deepinfer_backend_sampler():
    from deepinfer_core.sampling.sampler import TorchSampler
    from deepinfer_nvidia_sm100.kernels.bitmask import apply_token_bitmask
    from deepinfer_nvidia_sm100.kernels.noise import gumbel_noise

    # core's semantics; the noise from one fused kernel, structured outputs' token mask from another
    return TorchSampler(noise=gumbel_noise, bitmask=apply_token_bitmask)
