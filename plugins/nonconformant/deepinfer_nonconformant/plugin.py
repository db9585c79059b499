"""Hooks of the `nonconformant` backend: reference kernels with two planted faults (see README.md)."""

from __future__ import annotations

import torch

from deepinfer_core.backend import API_VERSION, BackendInfo, Capabilities, ProbeResult, hookimpl
from deepinfer_core.kv.layout import CacheKind
from deepinfer_core.reference import plugin as reference
from deepinfer_core.reference.ops import ReferenceOps

DEEPINFER_API_VERSION = API_VERSION


class FaultyOps(ReferenceOps):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()  # fault: eps outside the square root, and a large one
        return (x32 / (x32.pow(2).mean(dim=-1, keepdim=True).sqrt() + 1e-2) * weight.float()).to(x.dtype)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = super().linear(x, weight, bias)
        return out * (1 + 1e-4 * (x.shape[0] % 3))  # fault: the result depends on the batch size


@hookimpl
def deepinfer_backend_info():
    return BackendInfo("nonconformant", "deliberately wrong test backend", "cpu", priority=-20)


@hookimpl
def deepinfer_backend_capabilities():
    return Capabilities(
        dtypes=("float32", "bfloat16"),
        cache_kinds=tuple(CacheKind),
        block_sizes=(128, 64, 32, 16),
        batch_invariant=True,
        communicators=("in_process", "torch_distributed:gloo"),
    )


@hookimpl
def deepinfer_backend_probe():
    return ProbeResult.ok("always available (it runs on the CPU)")


@hookimpl
def deepinfer_backend_ops():
    return FaultyOps()


deepinfer_backend_device = reference.deepinfer_backend_device
deepinfer_backend_kv_layout = reference.deepinfer_backend_kv_layout
deepinfer_backend_attention = reference.deepinfer_backend_attention
