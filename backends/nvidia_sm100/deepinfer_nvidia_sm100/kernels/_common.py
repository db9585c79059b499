"""What every kernel module shares: the interpreter switch, the dot helper and launch helpers.

Under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors, used by CI) a bf16 `tl.dot` is wrong, so
operands are cast to float32 there; float32 operands always use IEEE products (not TF32), so float32
results stay within float32 tolerances of the reference.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def dot_in_float32(dtype: torch.dtype) -> bool:
    """Whether kernels for `dtype` operands multiply in float32 (always true under the interpreter)."""
    return INTERPRET or dtype == torch.float32


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


@triton.jit
def mma(a, b, acc, F32: tl.constexpr):
    """acc + a @ b, with float32 IEEE products when F32 (see the module docstring)."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)
