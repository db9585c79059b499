"""The op table and attention of the nvidia_sm100 backend: Triton kernels, cuBLAS (through torch) for
dense GEMMs in the default mode, the fixed-tiling Triton GEMM in batch-invariant mode and for FP8 weights
(ops.BlockFP8: each float8 tile is dequantized in registers with its block's scale, never in memory).

Imported only after the backend is selected (it imports triton).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer_core.backend.ops import BlockFP8, RoutingConfig
from deepinfer_nvidia_sm100.kernels import attention, elementwise, gemm, moe, routing

__all__ = ["NvidiaAttention", "NvidiaOps"]

Weight = torch.Tensor | BlockFP8  # a dense weight, or DeepSeek's FP8 format


class NvidiaOps:
    """Implements deepinfer_core.backend.ops.Ops on one GPU.

    batch_invariant: every op's result for a row must not depend on the other rows of the call. The
    row-local kernels and the grouped expert GEMM are so always; `linear` and `head_linear` then use
    the fixed-tiling Triton GEMM instead of cuBLAS, whose algorithm changes with the number of rows.
    """

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return elementwise.rms_norm(x, weight, eps)

    def rotary(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool
    ) -> torch.Tensor:
        return elementwise.rotary(x, positions, cos, sin, interleaved=interleaved)

    def linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.batch_invariant or isinstance(weight, BlockFP8):  # FP8 weights: scaled in the Triton GEMM
            return gemm.matmul(x, weight, bias)
        return F.linear(x, weight, bias)

    def head_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [T, H, K], weight [H, N, K] -> [T, H, N]."""
        if self.batch_invariant:
            return gemm.batched_matmul(x.transpose(0, 1), weight).transpose(0, 1)
        return torch.bmm(x.transpose(0, 1), weight.transpose(1, 2)).transpose(0, 1)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return elementwise.silu_and_mul(x)

    def moe_route(
        self, router_logits: torch.Tensor, config: RoutingConfig, correction_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return routing.moe_route(router_logits, config, correction_bias)

    def expert_ffn(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, w13: Weight, w2: Weight) -> torch.Tensor:
        return moe.expert_ffn(x, tokens_per_expert, w13, w2, fixed_tiles=self.batch_invariant)


class NvidiaAttention:
    """Implements AttentionOps over the row-per-slot paged cache of `ReferenceKVLayout`."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def paged_attention(self, q, cache, spec, meta, *, scale: float, value_dim: int, value_offset: int = 0):
        return attention.paged_attention(
            q, cache, spec, meta, self.block_size, scale=scale, value_dim=value_dim, value_offset=value_offset
        )
