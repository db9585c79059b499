"""Counter-based Gumbel noise in one kernel: the bits of deepinfer_core.sampling.noise.gumbel_noise
(32-bit lowbias32 mixing of the row hash and the token id, then -log(-log(u)) in float64, rounded once)
without its [B, V] int64 and float64 intermediates."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.sampling.noise import row_hashes


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _gumbel_kernel(row_hash_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    h = tl.load(row_hash_ptr + row).to(tl.uint32)  # the low 32 bits hold the row's hash
    x = _mix32(h ^ tokens.to(tl.uint32))  # uint32 arithmetic wraps, as the definition's modulo 2**32
    u = (x.to(tl.float64) + 0.5) / 4294967296.0
    g = -tl.log(-tl.log(u))
    tl.store(out_ptr + row * V + tokens, g.to(tl.float32), mask=tokens < V)


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise [B, V] float32, bit for bit core's definition."""
    hashes = row_hashes(seeds, steps).contiguous()  # [B], a few tiny tensor ops
    out = torch.empty((seeds.shape[0], vocab_size), dtype=torch.float32, device=seeds.device)
    if out.numel():
        block = 1024
        _gumbel_kernel[(seeds.shape[0], triton.cdiv(vocab_size, block))](hashes, out, vocab_size, BLOCK=block)
    return out
