"""Rotary tables for DeepSeek: plain RoPE or YaRN, and the attention-scale correction YaRN implies."""

from __future__ import annotations

import math

import torch

from deepinfer_core.model.config import RopeConfig

__all__ = ["rotary_tables", "softmax_scale"]


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _inverse_frequencies(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2] float32, factor applied to cos and sin)."""
    base_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope.kind == "default":
        return 1.0 / base_freqs, 1.0

    # YaRN: interpolate low frequencies by `factor`, keep high ones, ramp between the correction dims
    def correction_dim(rotations: float) -> float:
        return (
            dim
            * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(rope.theta))
        )

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    span = (high - low) or 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / span, 0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the original frequency), 0: interpolate
    inv_freq = (1.0 / (rope.factor * base_freqs)) * (1 - keep) + (1.0 / base_freqs) * keep
    if rope.attention_factor is not None:
        attention_factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(rope.factor, rope.mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(rope.factor)
    return inv_freq, attention_factor


def rotary_tables(rope: RopeConfig, dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, dim/2] float32 with YaRN's attention factor folded in."""
    inv_freq, attention_factor = _inverse_frequencies(rope, dim)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor


def softmax_scale(rope: RopeConfig, qk_head_dim: int) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek's long-context fix)."""
    scale = qk_head_dim**-0.5
    if rope.kind == "yarn" and rope.mscale_all_dim:
        scale *= _yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale
