# ruff: noqa: E501  (each op's docstring opens with its torch_npu schema line, verbatim)
"""Part of the documentation-based fake torch_npu (fake_torch_npu.py): the dense ops npu_rms_norm, npu_rotary_mul, npu_swiglu and npu_scatter_nd_update_."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from fake_npu_common import FLOATS, _require, _unsupported_by_fake


def npu_rms_norm(self, input, gamma, epsilon=1e-06):
    """npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)

    [PTA] y = x / sqrt(mean(x^2) + eps) * gamma over gamma's dims (the last dims of x); the second
    output is rstd = 1 / Rms(x), float32, shape x.shape[:-gamma.dim()] + (1,) * gamma.dim() [META].
    gamma's dtype must equal self's; dtypes float16/bfloat16/float32; 1-8 dims.
    """
    op = "npu_rms_norm"
    self._record(op, locals())
    _require(input.dtype in FLOATS, op, f"self dtype {input.dtype} is not float16/bfloat16/float32")
    _require(gamma.dtype == input.dtype, op, f"gamma dtype {gamma.dtype} must equal self's {input.dtype}")
    _require(1 <= input.dim() <= 8, op, f"self must have 1-8 dims, got {input.dim()}")
    _require(
        gamma.dim() <= input.dim() and tuple(gamma.shape) == tuple(input.shape[input.dim() - gamma.dim() :]),
        op,
        f"gamma shape {tuple(gamma.shape)} must be the last dims of self {tuple(input.shape)}",
    )
    dims = tuple(range(input.dim() - gamma.dim(), input.dim()))
    x = input.float()
    rstd = torch.rsqrt(x.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    return (x * rstd * gamma.float()).to(input.dtype), rstd


def npu_rotary_mul(self, input, r1, r2, rotary_mode="half", rotate=None):
    """npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half', Tensor? rotate=None) -> Tensor

    [PTA] half:       x1, x2 = chunk(x, 2, -1); out = r1 * x + r2 * cat(-x2, x1)
          interleave: out = r1 * x + r2 * stack(-x[..., 1::2], x[..., ::2]) interleaved back
    x, r1, r2 are 4-D; D even; r1/r2 broadcast to x (BSND: 1S1D, BS1D, BSND). ASSUMPTION: r1/r2 must
    have x's dtype (the docs list the same dtypes for all three and do not mention mixing). `rotate` is
    not in the API doc: the fake rejects it.
    """
    op = "npu_rotary_mul"
    self._record(op, locals())
    if rotate is not None:
        raise _unsupported_by_fake(op, "rotate")
    _require(
        rotary_mode in ("half", "interleave"),
        op,
        f"rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}",
    )
    for name, t in (("self", input), ("r1", r1), ("r2", r2)):
        _require(t.dim() == 4, op, f"{name} must be 4-D, got shape {tuple(t.shape)}")
        _require(t.dtype in FLOATS, op, f"{name} dtype {t.dtype} is not float16/bfloat16/float32")
    _require(r1.dtype == r2.dtype == input.dtype, op, "r1, r2 and self must share a dtype (ASSUMPTION)")
    _require(r1.shape == r2.shape, op, f"r1 {tuple(r1.shape)} and r2 {tuple(r2.shape)} differ")
    d = input.shape[-1]
    _require(d % 2 == 0, op, f"D must be even, got {d}")
    _require(r1.shape[-1] == d, op, f"r1's D {r1.shape[-1]} differs from self's {d}")
    for i in range(3):
        _require(
            r1.shape[i] in (1, input.shape[i]),
            op,
            f"r1 {tuple(r1.shape)} does not broadcast to self {tuple(input.shape)}",
        )
    if self.profile is not None:
        _require(d < 896, op, f"D must be < 896, got {d}")
    x, c, s = input.float(), r1.float(), r2.float()
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    else:
        rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return (c * x + s * rotated).to(input.dtype)


def npu_swiglu(self, input, dim=-1):
    """npu_swiglu(Tensor self, int dim=-1) -> Tensor

    [PTA] out = swish(A) * B = A * sigmoid(A) * B, A the first and B the second half of self along dim.
    self: 1-8 dims, float32/float16/bfloat16, dim size even, "不支持非连续的Tensor，不支持空Tensor".
    Computed in float32 and rounded once (ASSUMPTION: a fused kernel does not round silu(A) first).
    """
    op = "npu_swiglu"
    self._record(op, locals())
    _require(input.dtype in FLOATS, op, f"dtype {input.dtype} is not float16/bfloat16/float32")
    _require(1 <= input.dim() <= 8, op, f"self must have 1-8 dims, got {input.dim()}")
    _require(-input.dim() <= dim < input.dim(), op, f"dim {dim} out of range for {input.dim()} dims")
    _require(input.shape[dim] % 2 == 0, op, f"size {input.shape[dim]} along dim {dim} is odd")
    _require(input.numel() > 0, op, "empty tensors are not supported")
    _require(input.is_contiguous(), op, "non-contiguous tensors are not supported")
    a, b = input.float().chunk(2, dim=dim)
    return (F.silu(a) * b).to(input.dtype)


def npu_scatter_nd_update_(self, input, indices, updates):
    """npu_scatter_nd_update_(Tensor(a!) self, Tensor indices, Tensor updates) -> Tensor(a!)

    [PTA] In place: self[indices[i]] = updates[i], where each row of indices (last dim a <= self.dim())
    indexes self's first a dims; updates.shape == indices.shape[:-1] + self.shape[a:]. indices int32 or
    int64, at least 2-D, never out of range; self and updates share a dtype; self 1-8 dims.
    ASSUMPTION: duplicate indices are rejected (the docs do not say which write wins).
    """
    op = "npu_scatter_nd_update_"
    self._record(op, locals())
    allowed = (torch.float32, torch.float16, torch.bfloat16, torch.bool, torch.int64, torch.int8)
    _require(input.dtype in allowed, op, f"self dtype {input.dtype} is not supported")
    _require(updates.dtype == input.dtype, op, f"updates dtype {updates.dtype} must equal self's {input.dtype}")
    _require(indices.dtype in (torch.int32, torch.int64), op, f"indices dtype {indices.dtype} must be int32/int64")
    _require(1 <= input.dim() <= 8, op, f"self must have 1-8 dims, got {input.dim()}")
    _require(indices.dim() >= 2, op, f"indices must be at least 2-D, got {tuple(indices.shape)}")
    depth = indices.shape[-1]
    _require(depth <= input.dim(), op, f"index depth {depth} exceeds self's {input.dim()} dims")
    expected = tuple(indices.shape[:-1]) + tuple(input.shape[depth:])
    _require(tuple(updates.shape) == expected, op, f"updates shape {tuple(updates.shape)} must be {expected}")
    flat = indices.reshape(-1, depth).long()
    for d in range(depth):
        _require(bool(((flat[:, d] >= 0) & (flat[:, d] < input.shape[d])).all()), op, "indices out of range")
    _require(len(set(map(tuple, flat.tolist()))) == flat.shape[0], op, "duplicate indices (ASSUMPTION: rejected)")
    input[tuple(flat.unbind(-1))] = updates.reshape(flat.shape[0], *input.shape[depth:])
    return input
