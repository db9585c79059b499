"""Row-local kernels: RMSNorm, rotary embedding, SiLU-and-multiply (with DeepSeek-V4's optional swiglu
limit), and the activation helpers the grouped expert GEMM's epilogue shares. One program per row (or row
tile); each output depends only on its own row, so all three are batch-invariant by construction."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer_nvidia_sm100.kernels._common import next_pow2


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, D, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> x / sqrt(mean(x^2) + eps) * weight, float32 inside, x.dtype out."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight.contiguous(), out, rows.stride(0), out.stride(0), rows.shape[1], eps,
            BLOCK_D=next_pow2(rows.shape[1]),
        )  # fmt: skip
    return out.view(x.shape)


@triton.jit
def _rotary_kernel(
    x_ptr, pos_ptr, cos_ptr, sin_ptr, out_ptr, H, stride_xt, stride_xh, stride_cos,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    pairs = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < H) & (pairs < HALF)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.load(cos_ptr + pos * stride_cos + pairs, mask=pairs < HALF, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_cos + pairs, mask=pairs < HALF, other=0.0).to(tl.float32)
    if INTERLEAVED:  # pairs (2i, 2i+1)
        first, second = 2 * pairs, 2 * pairs + 1
    else:  # pairs (i, i + R/2)
        first, second = pairs, pairs + HALF
    row = x_ptr + t * stride_xt + heads * stride_xh
    a = tl.load(row + first, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(row + second, mask=mask, other=0.0).to(tl.float32)
    out = out_ptr + t * H * 2 * HALF + heads * 2 * HALF
    dtype = out_ptr.dtype.element_ty
    tl.store(out + first, (a * c - b * s).to(dtype), mask=mask)
    tl.store(out + second, (b * c + a * s).to(dtype), mask=mask)


def rotary(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool
) -> torch.Tensor:
    """Rotate x [T, H, R] (any strides with a unit last stride) by `positions` [T]; a new contiguous tensor."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    tokens, heads, rot = x.shape
    out = torch.empty((tokens, heads, rot), dtype=x.dtype, device=x.device)
    cos, sin = cos.contiguous(), sin.contiguous()
    if tokens:
        _rotary_kernel[(tokens,)](
            x, positions, cos, sin, out, heads, x.stride(0), x.stride(1), cos.stride(0),
            HALF=rot // 2, BLOCK_H=next_pow2(heads), BLOCK_HALF=next_pow2(rot // 2), INTERLEAVED=interleaved,
        )  # fmt: skip
    return out


@triton.jit
def silu_mul_rounded(gate, up, dtype: tl.constexpr, limit, HAS_LIMIT: tl.constexpr):
    """silu(gate) * up as the reference rounds it: silu rounded to `dtype`, then the product rounded.

    HAS_LIMIT (V4's swiglu_limit): silu(min(gate, limit)) * clamp(up, -limit, limit), where `limit` is
    already rounded to `dtype` (`limit_in`): clamping a `dtype` value in float32 against it is then exact,
    the reference's clamp in `dtype`. NaNs stay NaN, as torch.clamp keeps them.
    """
    g, u = _clamped(gate, up, limit, HAS_LIMIT)
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return (act * u).to(dtype)


@triton.jit
def silu_mul_float32(gate, up, limit, HAS_LIMIT: tl.constexpr):
    """silu(gate) * up all in float32, nothing rounded (DeepSeek-V4.1's row-scaled activation, which is
    rounded once, after the routing weight). HAS_LIMIT: clamped in float32 against `limit` as given."""
    g, u = _clamped(gate, up, limit, HAS_LIMIT)
    return (g / (1.0 + tl.exp(-g))) * u


@triton.jit
def _clamped(gate, up, limit, HAS_LIMIT: tl.constexpr):
    """(min(gate, limit), clamp(up, -limit, limit)) in float32 when HAS_LIMIT, else gate and up in float32."""
    g = gate.to(tl.float32)
    u = up.to(tl.float32)
    if HAS_LIMIT:
        g = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)
        u = tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL)
        u = tl.minimum(u, limit, propagate_nan=tl.PropagateNan.ALL)
    return g, u


@functools.lru_cache(maxsize=64)
def limit_in(limit: float | None, dtype: torch.dtype) -> tuple[float, bool]:
    """(the swiglu limit rounded to `dtype`, HAS_LIMIT) as kernel arguments; (0.0, False) for no limit.
    Rounded here on the host (a Python float, no device work): the clamped value the reference produces.
    Pass dtype float32 for a clamp in float32 (V4.1's row-scaled activation)."""
    if limit is None:
        return 0.0, False
    return float(torch.tensor(limit, dtype=torch.float32).to(dtype)), True


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_out, inner, limit, BLOCK: tl.constexpr, HAS_LIMIT: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inner + cols, mask=mask, other=0.0)
    out = out_ptr + row * stride_out + cols  # before the activation, as ever: no limit compiles the same code
    tl.store(out, silu_mul_rounded(gate, up, out_ptr.dtype.element_ty, limit, HAS_LIMIT), mask=mask)


def silu_and_mul(x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up [T, I]; with `limit`, silu(min(gate, limit)) *
    clamp(up, -limit, limit) in the same launch."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    inner = x.shape[-1] // 2
    out = torch.empty((x.shape[0], inner), dtype=x.dtype, device=x.device)
    block = min(1024, next_pow2(inner))
    value, has_limit = limit_in(limit, x.dtype)
    if x.shape[0]:
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(inner, block))](
            x, out, x.stride(0), out.stride(0), inner, value, BLOCK=block, HAS_LIMIT=has_limit
        )
    return out
