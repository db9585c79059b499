"""Host <-> device copies that never make the host wait for the device's queued work.

Generic torch only: pinned host memory where the device is not the CPU (a backend without it gets
ordinary copies), and `torch.Event` to know when a device -> host copy has landed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["HostCopy", "host_staging", "to_device"]


def _pinned(tensor: torch.Tensor) -> torch.Tensor:
    try:
        return tensor.pin_memory()
    except (RuntimeError, NotImplementedError):  # no pinned memory on this machine: a plain copy, still correct
        return tensor


def host_staging(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty host tensor to fill and then copy to `device` with non_blocking=True: pinned where the device
    is not the CPU (the copy is then asynchronous), ordinary memory where pinning is unavailable."""
    if device.type != "cpu":
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        except (RuntimeError, NotImplementedError):  # no pinned memory on this machine: torch stages the copy
            pass
    return torch.empty(shape, dtype=dtype)


def to_device(values: torch.Tensor | Sequence, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Host values on `device`, copied without waiting for the work the device has queued (from pinned
    memory the copy itself is asynchronous; without pinned memory torch stages it safely)."""
    tensor = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return tensor
    return _pinned(tensor).to(device, non_blocking=True)


class HostCopy:
    """Device -> host copy of a step's results, started when the step is issued and read later.

    `wait()` waits for this copy only (an event recorded right after it), not for work queued since.
    Where events or pinned memory are missing, the copy is made by `wait()` instead, blocking on
    whatever the device has queued by then.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._tensors = list(tensors)
        self._event = None
        device = self._tensors[0].device if self._tensors else torch.device("cpu")
        if device.type == "cpu":
            return
        try:
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in self._tensors]
            for target, source in zip(host, self._tensors):
                target.copy_(source, non_blocking=True)
            event = torch.Event(device=device)
            event.record()
        except (RuntimeError, NotImplementedError, TypeError, ValueError, AttributeError):
            return  # keep the device tensors: wait() copies them, blocking
        self._tensors, self._event = host, event

    def wait(self) -> list[torch.Tensor]:
        """The tensors, on the host."""
        if self._event is not None:
            self._event.synchronize()
        return [t.cpu() for t in self._tensors]
