"""Engine build: call a selected backend's hooks once and keep the objects they return.

After `resolve_backend`, the engine and model code call these objects directly; pluggy is never on
the per-token path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_core.backend._steps import CostModel, GraphCapture, StepTimer, WallClockStepTimer
from deepinfer_core.backend.ops import AttentionOps, Ops
from deepinfer_core.backend.registry import BackendEntry
from deepinfer_core.backend.types import BackendInfo, Capabilities, DeviceFacts
from deepinfer_core.errors import BackendContractError, BackendSelectionError
from deepinfer_core.kv.layout import KVLayout
from deepinfer_core.parallel.communicator import ExpertCommunicator
from deepinfer_core.sampling.sampler import Sampler

__all__ = ["ResolvedBackend", "resolve_backend"]


@dataclass(frozen=True, slots=True)
class ResolvedBackend:
    info: BackendInfo
    capabilities: Capabilities
    device: DeviceFacts
    dtype: torch.dtype
    ops: Ops
    kv_layout: KVLayout
    attention: AttentionOps
    sampler: Sampler
    communicator: ExpertCommunicator
    cost_model: CostModel
    batch_invariant: bool = False  # ops and attention were built for batch-invariant mode
    graphs: GraphCapture | None = None  # device-graph capture of decode steps, where the backend has it
    step_timer: StepTimer = WallClockStepTimer()  # times whole steps on the device (start-up profiling)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device.torch_device)


def _checked(backend: BackendEntry, hook: str, value, expected: type):
    if not isinstance(value, expected):
        raise BackendContractError(
            f"backend {backend.name} ({backend.origin.distribution}): {hook} returned "
            f"{type(value).__name__}, expected {expected.__name__}. This is a bug in the backend."
        )
    return value


def resolve_backend(
    backend: BackendEntry,
    *,
    dtype: torch.dtype = torch.float32,
    device_index: int = 0,
    world_size: int = 1,
    rank: int = 0,
    block_size: int | None = None,
    batch_invariant: bool = False,
) -> ResolvedBackend:
    """Build everything an engine needs from `backend` for one device and compute dtype.

    batch_invariant: ask for ops whose per-request results do not depend on the rest of the batch
    (an error if the backend's capabilities do not offer it).
    """
    if not backend.available:
        raise BackendSelectionError(f"backend {backend.name} is not available: {backend.reason}")
    dtype_name = str(dtype).removeprefix("torch.")
    if dtype_name not in backend.capabilities.dtypes:
        supported = ", ".join(backend.capabilities.dtypes)
        raise BackendSelectionError(f"backend {backend.name} does not compute in {dtype_name}; it supports {supported}")
    if block_size is not None and block_size not in backend.capabilities.block_sizes:
        sizes = ", ".join(map(str, backend.capabilities.block_sizes))
        raise BackendSelectionError(
            f"backend {backend.name} does not take {block_size}-token KV blocks; it takes {sizes}"
        )
    if batch_invariant and not backend.capabilities.batch_invariant:
        raise BackendSelectionError(
            f"backend {backend.name} has no batch-invariant mode (its capabilities say batch_invariant=False); "
            f"run without --batch-invariant or pick a backend that offers it"
        )
    hook = backend.manager.hook
    device = _checked(
        backend, "deepinfer_backend_device", hook.deepinfer_backend_device(index=device_index), DeviceFacts
    )
    layout = _checked(
        backend,
        "deepinfer_backend_kv_layout",
        hook.deepinfer_backend_kv_layout(device=device, block_size=block_size),
        KVLayout,
    )
    return ResolvedBackend(
        info=backend.info,
        capabilities=backend.capabilities,
        device=device,
        dtype=dtype,
        ops=_checked(
            backend,
            "deepinfer_backend_ops",
            hook.deepinfer_backend_ops(device=device, dtype=dtype, batch_invariant=batch_invariant),
            Ops,
        ),
        kv_layout=layout,
        attention=_checked(
            backend,
            "deepinfer_backend_attention",
            hook.deepinfer_backend_attention(
                device=device, layout=layout, dtype=dtype, batch_invariant=batch_invariant
            ),
            AttentionOps,
        ),
        sampler=_checked(backend, "deepinfer_backend_sampler", hook.deepinfer_backend_sampler(device=device), Sampler),
        communicator=_checked(
            backend,
            "deepinfer_backend_communicator",
            hook.deepinfer_backend_communicator(device=device, world_size=world_size, rank=rank),
            ExpertCommunicator,
        ),
        cost_model=_checked(
            backend,
            "deepinfer_backend_cost_model",
            hook.deepinfer_backend_cost_model(device=device, dtype=dtype),
            CostModel,
        ),
        batch_invariant=batch_invariant,
        graphs=_graph_capture(backend, device),
        step_timer=_checked(
            backend, "deepinfer_backend_step_timer", hook.deepinfer_backend_step_timer(device=device), StepTimer
        ),
    )


def _graph_capture(backend: BackendEntry, device: DeviceFacts) -> GraphCapture | None:
    if not backend.capabilities.graph_capture:
        return None
    capture = backend.manager.hook.deepinfer_backend_graph_capture(device=device)
    return None if capture is None else _checked(backend, "deepinfer_backend_graph_capture", capture, GraphCapture)
