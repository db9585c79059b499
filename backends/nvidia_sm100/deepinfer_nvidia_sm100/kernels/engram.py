"""DeepSeek-V4.1's engram injection, `engram_gate`, in one launch where the reference takes a dozen: per token
and stream, the gate from the normalised dot of the stream with its engram key, then the stream plus the gated
value. Row-local (one program per token and stream, every sum in an order fixed by D), so batch-invariant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia_sm100.kernels._common import next_pow2


@triton.jit
def _engram_gate_kernel(
    streams_ptr, key_ptr, value_ptr, weight_ptr, dead_ptr, out_ptr, D, eps, inv_sqrt_d,
    ss_t, ss_n, sk_t, sk_n, sv_t, sw_n, BD: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1).to(tl.int64)
    h_row, k_row = streams_ptr + t * ss_t + n * ss_n, key_ptr + t * sk_t + n * sk_n
    h_squares = tl.zeros([BD], dtype=tl.float32)
    k_squares = tl.zeros([BD], dtype=tl.float32)
    products = tl.zeros([BD], dtype=tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        h = tl.load(h_row + d, mask=d < D, other=0.0).to(tl.float32)
        k = tl.load(k_row + d, mask=d < D, other=0.0).to(tl.float32)
        w = tl.load(weight_ptr + n * sw_n + d, mask=d < D, other=0.0).to(tl.float32)
        h_squares += h * h
        k_squares += k * k
        products += h * w * k
    rstd = tl.rsqrt(tl.sum(h_squares, axis=0) / D + eps) * tl.rsqrt(tl.sum(k_squares, axis=0) / D + eps)
    dot = tl.sum(products, axis=0) * rstd * inv_sqrt_d
    root = tl.sqrt(tl.maximum(tl.abs(dot), 1e-6))
    gate = 1.0 / (1.0 + tl.exp(-tl.where(dot > 0, root, tl.where(dot < 0, -root, 0.0))))  # sigmoid(sign * root)
    gate = tl.where(tl.load(dead_ptr + t) != 0, 0.0, gate)  # dead (pad / image) tokens take no memory
    out = out_ptr + (t * tl.num_programs(1) + n) * D
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        h = tl.load(h_row + d, mask=d < D, other=0.0).to(tl.float32)
        v = tl.load(value_ptr + t * sv_t + d, mask=d < D, other=0.0).to(tl.float32)
        tl.store(out + d, (h + gate * v).to(out_ptr.dtype.element_ty), mask=d < D)


def engram_gate(
    streams: torch.Tensor, key: torch.Tensor, value: torch.Tensor, weight: torch.Tensor, dead: torch.Tensor, eps: float
) -> torch.Tensor:
    """streams, key [T, N, D], value [T, D], weight [N, D], dead [T] -> streams + gate * value [T, N, D] in
    streams.dtype, all in float32 (see V41Ops.engram_gate)."""
    tokens, n, hidden = streams.shape
    streams, key, value, weight = (t if t.stride(-1) == 1 else t.contiguous() for t in (streams, key, value, weight))
    dead = dead.bool().contiguous()
    out = torch.empty((tokens, n, hidden), dtype=streams.dtype, device=streams.device)
    if tokens:
        _engram_gate_kernel[(tokens, n)](
            streams, key, value, weight, dead, out, hidden, eps, hidden**-0.5,
            streams.stride(0), streams.stride(1), key.stride(0), key.stride(1), value.stride(0), weight.stride(0),
            BD=min(1024, next_pow2(hidden)),
        )  # fmt: skip
    return out
