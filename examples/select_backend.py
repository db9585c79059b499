"""Pick a backend the way the engine will, resolve it once, and run two of its ops.

    python examples/select_backend.py                # DEEPINFER_ACCELERATOR or auto
    python examples/select_backend.py --accelerator cpu
"""

import argparse
import sys

import torch

from deepinfer_core.backend.registry import discover
from deepinfer_core.backend.resolve import resolve_backend
from deepinfer_core.backend.selection import select_backend
from deepinfer_core.errors import DeepInferError


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default=None)
    args = parser.parse_args()
    try:
        backend = resolve_backend(select_backend(discover(), args.accelerator))
    except DeepInferError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    device = backend.torch_device
    x = torch.randn(4, 64, device=device)  # [T, D]
    normed = backend.ops.rms_norm(x, torch.ones(64, device=device), 1e-6)
    logits = backend.ops.linear(normed, torch.randn(100, 64, device=device))  # [T, V]
    print(f"backend {backend.info.name} on {backend.device.name}: rms_norm + linear -> {tuple(logits.shape)}")
    print(f"KV blocks of {backend.kv_layout.block_size} tokens; sampler {type(backend.sampler).__name__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
