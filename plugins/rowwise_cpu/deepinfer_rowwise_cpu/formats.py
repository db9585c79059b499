"""DeepSeek-V4.1's block formats (deepinfer_core.backend.ops.BLOCK_FORMATS): the value a row of blocks takes
when stored in one, in float32; imports only torch and the contract's format names.

A format stores each block of channels as one scale times small elements: FP8 e4m3 elements under a power
of two ("fp8_e4m3/pow2:32"), FP4 e2m1 elements under a power of two ("fp4_e2m1/pow2:32") or under an e4m3
scale ("fp4_e2m1/e4m3:16"). e2m1 is rounded here as the float it is — two exponent bits, one mantissa bit,
so its values {0, .5, 1, 1.5, 2, 3, 4, 6} lie 0.5 apart below 2 and 2^(E - 1) apart in [2^E, 2^(E + 1)):
rounding to the grid is rounding |q| / spacing to an integer, half to even (torch.round), which is the
contract's tie rule (0.25, 1.25, 2.5, 5 down; 0.75, 1.75, 3.5 up).
"""

from __future__ import annotations

import torch

from deepinfer_core.backend.ops import BLOCK_FORMATS

__all__ = ["block_channels", "round_blocks"]

E4M3_MAX = 448.0  # the largest float8_e4m3fn
E2M1_MAX = 6.0  # the largest FP4 e2m1


def block_channels(fmt: str) -> int:
    """The block size (channels along the last dim) of format `fmt`; ValueError for an unknown one."""
    if fmt not in BLOCK_FORMATS:
        raise ValueError(f"unknown block format {fmt!r}: rowwise_cpu rounds to {', '.join(BLOCK_FORMATS)}")
    return int(fmt.rsplit(":", 1)[1])


def _pow2_ceil(t: torch.Tensor) -> torch.Tensor:
    """The contract's pow2ceil of t >= 0 float32: the power of two whose exponent field is t's, plus one when
    t's mantissa field is not zero (2^ceil(log2 t) for normal t); built from the bits, so nothing rounds."""
    bits = t.view(torch.int32)  # sign bit clear
    exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)  # that exponent field, mantissa 0


def _round_e2m1(q: torch.Tensor) -> torch.Tensor:
    """q [..] float32 in [-6, 6] -> the nearest e2m1 value (ties to the even mantissa); a zero is +0."""
    magnitude = q.abs()
    _, exponent = torch.frexp(magnitude)  # magnitude = m * 2^exponent, m in [0.5, 1); 0 for a zero
    spacing = torch.ldexp(torch.ones_like(magnitude), torch.clamp(exponent, min=1) - 2)  # 0.5, 0.5, 1, 2
    rounded = torch.round(magnitude / spacing) * spacing  # the division by a power of two is exact
    return torch.where((q < 0) & (rounded > 0), -rounded, rounded)


def round_blocks(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """One row's blocks [B, block] float32 -> the values they take stored in `fmt` [B, block] float32."""
    amax = blocks.abs().amax(dim=1, keepdim=True)  # [B, 1]
    if fmt == "fp8_e4m3/pow2:32":
        scale = _pow2_ceil(torch.clamp(amax, min=1e-4) * (1 / E4M3_MAX))
        elements = torch.clamp(blocks / scale, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()  # RNE
        return elements * scale
    if fmt == "fp4_e2m1/pow2:32":
        scale = _pow2_ceil(torch.clamp(amax, min=E2M1_MAX * 2**-126) * (1 / E2M1_MAX))
    else:  # "fp4_e2m1/e4m3:16": the scale is itself stored in e4m3
        scale = (torch.clamp(amax, min=E2M1_MAX * 2**-9) / E2M1_MAX).to(torch.float8_e4m3fn).float()
    return _round_e2m1(torch.clamp(blocks / scale, -E2M1_MAX, E2M1_MAX)) * scale
