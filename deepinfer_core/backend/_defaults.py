"""Core's answers to the optional backend hooks, registered `trylast` in every backend's manager."""

from __future__ import annotations

import torch

from deepinfer_core.backend._steps import LinearCostModel, WallClockStepTimer
from deepinfer_core.backend.hookspecs import hookimpl
from deepinfer_core.backend.types import DeviceFacts
from deepinfer_core.parallel.communicator import AllToAllCommunicator, InProcessCommunicator
from deepinfer_core.sampling.sampler import TorchSampler


@hookimpl(trylast=True)
def deepinfer_backend_sampler(device: DeviceFacts):
    return TorchSampler()


@hookimpl(trylast=True)
def deepinfer_backend_communicator(device: DeviceFacts, world_size: int, rank: int):
    return InProcessCommunicator() if world_size == 1 else AllToAllCommunicator()


@hookimpl(trylast=True)
def deepinfer_backend_cost_model(device: DeviceFacts, dtype: torch.dtype):
    return LinearCostModel()


@hookimpl(trylast=True)
def deepinfer_backend_step_timer(device: DeviceFacts):
    return WallClockStepTimer()
