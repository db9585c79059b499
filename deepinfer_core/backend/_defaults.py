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
    # an expert-parallel world is torch.distributed's default group, of any size (one included: a rank process
    # of --data-parallel-size 1 --enable-expert-parallel runs its MoE traffic through the backend's collectives)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if world_size > 1 or (distributed and torch.distributed.get_world_size() == world_size):
        return AllToAllCommunicator()
    return InProcessCommunicator()


@hookimpl(trylast=True)
def deepinfer_backend_cost_model(device: DeviceFacts, dtype: torch.dtype):
    return LinearCostModel()


@hookimpl(trylast=True)
def deepinfer_backend_step_timer(device: DeviceFacts):
    return WallClockStepTimer()
