"""Part of the documentation-based fake torch_npu (fake_torch_npu.py): what its op modules share."""

from __future__ import annotations

import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
HALVES = (torch.float16, torch.bfloat16)
MASK_SIZE = 2048


class DocViolation(ValueError):
    """An argument combination that torch_npu's / CANN's documentation forbids."""


def _require(condition: bool, op: str, message: str) -> None:
    if not condition:
        raise DocViolation(f"{op}: {message}")


def _unsupported_by_fake(op: str, what: str) -> NotImplementedError:
    return NotImplementedError(f"{op}: {what} is documented but not implemented by this fake")
