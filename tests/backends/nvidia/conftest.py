"""The nvidia_sm100 kernels run here under Triton's interpreter, on CPU tensors, on tiny shapes.

TRITON_INTERPRET must be set before triton decorates the kernels, so it is set at collection time,
before any kernel module is imported; the kernels then multiply in float32 (bf16 dots are wrong
under the interpreter), which the comparisons' tolerances allow for.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (tox installs it for the interpreted kernel tests)")

from triton.runtime import interpreter  # noqa: E402  (imported only once triton is known to be there)


def _dot_summed_in_k_order(self, a, b, d, input_precision, max_num_imprecise_acc):
    """d + a @ b with every element summed over k = 0, 1, ... in float32: the same operations for every element."""
    x, y, acc = a.data, b.data, d.data  # [.., M, K], [.., K, N], [.., M, N]
    if not x.dtype == y.dtype == acc.dtype == np.float32:  # dot_in_float32 is always true under the interpreter
        raise TypeError(f"expected float32 dot operands and accumulator, got {x.dtype}, {y.dtype}, {acc.dtype}")
    out = np.zeros(acc.shape, dtype=np.float32)
    for k in range(x.shape[-1]):
        out += x[..., :, k, None] * y[..., k, None, :]
    return interpreter.TensorHandle(out + acc, d.dtype.scalar)


@pytest.fixture
def fixed_order_dot(monkeypatch):
    """Makes the interpreter's tl.dot compute each output row the same way wherever the row sits in its tile.

    The interpreter's tl.dot is numpy's matmul, and a BLAS may round a row differently by its place in the
    tile: OpenBLAS's Haswell kernel (the one AVX2 CPUs such as AMD EPYC get) gives rows 6-15 of a 16-row tile
    other bits than row 0. A bitwise batch-invariance test would then check the CPU's BLAS, not the kernel.
    Under this fixture the dot is a fixed-order float32 sum (no BLAS, no threads), so whatever bits differ
    between two ways of batching come from the kernel's own tiling and reduction order, on any CPU. That a
    GPU's dot has the same property is part of what `deepinfer conformance` checks on the GPU."""
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", _dot_summed_in_k_order)
