"""The nvidia_sm100 kernels run here under Triton's interpreter, on CPU tensors, on tiny shapes.

TRITON_INTERPRET must be set before triton decorates the kernels, so it is set at collection time,
before any kernel module is imported; the kernels then multiply in float32 (bf16 dots are wrong
under the interpreter), which the comparisons' tolerances allow for.
"""

from __future__ import annotations

import os
import types

import numpy as np
import pytest

os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (tox installs it for the interpreted kernel tests)")

import triton.language as tl  # noqa: E402  (imported only once triton is known to be there)
from triton.runtime import interpreter  # noqa: E402


def _patch_lang_once_per_launch() -> None:
    """Makes the interpreter patch triton.language once per kernel launch, not again at every device-function call.

    A launch (GridExecutor) patches the tl modules its kernel's globals hold and restores them when its grid has
    run; each call of a @triton.jit function inside it (InterpretedFunction.__call__: our helpers, tl.sum, tl.max,
    tl.zeros ...) patched tl and tl.core again, to the same values, into a scope it drops (tl.core then stayed
    patched): ~2 ms a call, thousands of calls a test. Here a launch patches both tl and tl.core, restored after its
    grid, and the calls inside it run on those patches. The kernels compute exactly as before. Left alone where
    triton's interpreter is not laid out as 3.7's."""
    if not all(hasattr(interpreter, n) for n in ("_patch_lang", "_LangPatchScope", "GridExecutor")):
        return
    patch_lang, grid_call = interpreter._patch_lang, interpreter.GridExecutor.__call__
    every_lang = types.SimpleNamespace(__globals__={"tl": tl, "core": tl.core})  # what _patch_lang looks at
    launches: list[bool] = []  # per running launch: whether it has patched yet

    def patched_once(fn):
        if not launches:  # a call outside any launch: as the interpreter does it
            return patch_lang(fn)
        if launches[-1]:  # a call inside a launch: everything it could patch is patched
            return interpreter._LangPatchScope()
        launches[-1] = True  # the launch's own patching, restored by the launch
        return patch_lang(every_lang)

    def launch(self, *args, **kwargs):
        launches.append(False)
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            launches.pop()

    interpreter._patch_lang, interpreter.GridExecutor.__call__ = patched_once, launch


_patch_lang_once_per_launch()


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
