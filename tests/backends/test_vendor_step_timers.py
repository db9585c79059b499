"""The in-tree vendor backends' step timers (hook `deepinfer_backend_step_timer`): built without touching the
device runtime, and of the contract's type. Timing itself needs the device: tests/backends/nvidia_gpu."""

from __future__ import annotations

import torch

from deepinfer_core.backend import DeviceFacts, StepTimer
from deepinfer_nvidia_sm100 import plugin as nvidia
from deepinfer_nvidia_sm100.timing import CudaEventStepTimer


def test_nvidia_times_steps_with_device_events():
    device = DeviceFacts("NVIDIA H200", "cuda:0", 1 << 30, 1 << 30)
    timer = nvidia.deepinfer_backend_step_timer(device=device)
    assert isinstance(timer, CudaEventStepTimer) and isinstance(timer, StepTimer)
    assert timer.device == torch.device("cuda:0")
    if not torch.cuda.is_available():
        assert not torch.cuda.is_initialized()  # building it touched no CUDA API
