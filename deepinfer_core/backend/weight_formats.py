"""The quantized weight formats DeepSeek's checkpoints ship, as model code hands them to `linear` / `expert_ffn`.

- BlockFP8 ("fp8_block"): float8 e4m3 values, one scale per [bn, bk] block of the last two dims (128 x 128 in
  V3 / V4, 32 x 32 in V4.1). The scale is float32 (V3's `weight_scale_inv`; V4 Flash-Base) or E8M0, a power of
  two in one byte (V4 / V4.1's `.scale`, `scale_fmt: ue8m0`). Either way it multiplies: value = q * scale.
- MXFP4 ("mxfp4"): FP4 e2m1 values packed two to a byte along K (element 2i in the low nibble of byte i, 2i + 1 in
  the high one; a code is the sign bit, then the magnitude's index in 0, .5, 1, 1.5, 2, 3, 4, 6), one E8M0 scale
  per 32 along K: V4 / V4.1's routed experts (`expert_dtype: fp4`), the OCP MX layout.

E8M0 byte b is 2^(b - 127): 0 is 2^-127 and 255 is NaN (torch.float8_e8m0fnu's reading, which `dequantize` uses).
A NaN scale dequantizes its whole block to NaN; e4m3fn's NaN codes (0x7F, 0xFF) dequantize to NaN; e2m1 has no
NaN or infinity. `quantize` refuses weights that are not finite. Backends name the formats they compute with in
Capabilities.weight_formats; the loader dequantizes the others (`dequantize`) to the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from deepinfer_core.kv.formats import E2M1_MAX, E4M3_MAX, e2m1_codes, e2m1_values, pow2_ceil

__all__ = [
    "BlockFP8",
    "MXFP4",
    "QuantizedWeight",
    "Weight",
    "concat_rows",
    "dequantized",
    "stack",
    "weight_bytes",
    "weight_format",
]

E8M0 = torch.float8_e8m0fnu
MX_BLOCK = 32  # MXFP4's scale block along K


def e8m0_from_pow2(power_of_two: torch.Tensor) -> torch.Tensor:
    """Powers of two (float32, 2^-127 .. 2^127) -> their E8M0 bytes, as torch.float8_e8m0fnu."""
    return ((power_of_two.float().view(torch.int32) >> 23) & 0xFF).to(torch.uint8).view(E8M0)


def _check_finite(weight: torch.Tensor, fmt: str) -> None:
    if not torch.isfinite(weight).all():
        raise ValueError(f"cannot quantize a weight with NaN or infinite values to {fmt}: check the weight first")


@dataclass(frozen=True, slots=True)
class BlockFP8:
    """A weight kept as float8_e4m3fn values with one scale per [block[0], block[1]] block of its last two dims.

    Model code passes it wherever a `linear` weight ([N, K], scale [ceil(N/bn), ceil(K/bk)]) or an `expert_ffn`
    weight ([E, N, K], scale [E, ceil(N/bn), ceil(K/bk)]) goes, but only to backends whose
    Capabilities.weight_formats include "fp8_block"; the value it stands for is `dequantize()`.
    """

    weight: torch.Tensor  # float8_e4m3fn [.., N, K]
    scale: torch.Tensor  # float32 or float8_e8m0fnu (powers of two) [.., ceil(N/bn), ceil(K/bk)]
    block: tuple[int, int] = (128, 128)

    format = "fp8_block"

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def pow2_scales(self) -> bool:
        """Whether the scales are E8M0 bytes (else float32 multipliers)."""
        return self.scale.dtype == E8M0

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes

    def to(self, device: torch.device | str) -> BlockFP8:
        return BlockFP8(self.weight.to(device), self.scale.to(device), self.block)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """weight * scale, computed in float32 (exact: a power-of-two scale only moves the exponent), in `dtype`."""
        rows, cols = self.weight.shape[-2:]
        scale = self.scale.float().repeat_interleave(self.block[0], dim=-2).repeat_interleave(self.block[1], dim=-1)
        return (self.weight.float() * scale[..., :rows, :cols]).to(dtype)

    @classmethod
    def quantize(
        cls,
        weight: torch.Tensor,
        block: tuple[int, int] = (128, 128),
        scales: Literal["float32", "e8m0"] = "float32",
    ) -> BlockFP8:
        """Quantize a [.., N, K] weight per block, as DeepSeek's checkpoints are: scale = amax / 448 in float32
        (V3), or the power of two 2^ceil(log2(amax / 448)) as E8M0 (V4's ue8m0: no element clips)."""
        _check_finite(weight, "fp8_block")
        rows, cols = weight.shape[-2:]
        bn, bk = block
        padded = torch.nn.functional.pad(weight.float(), (0, -cols % bk, 0, -rows % bn))
        tiles = padded.unflatten(-1, (-1, bk)).unflatten(-3, (-1, bn))  # [.., N/bn, bn, K/bk, bk]
        amax = tiles.abs().amax(dim=(-3, -1))  # [.., N/bn, K/bk]
        if scales == "e8m0":
            scale = pow2_ceil(amax.clamp_min(1e-4) * (1 / E4M3_MAX))
        elif scales == "float32":
            scale = amax.clamp_min(1e-12) / E4M3_MAX
        else:
            raise ValueError(f"unknown fp8_block scale format {scales!r}; use 'float32' or 'e8m0'")
        expanded = scale.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)[..., :rows, :cols]
        values = (weight.float() / expanded).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return cls(values, e8m0_from_pow2(scale) if scales == "e8m0" else scale, block)


@dataclass(frozen=True, slots=True)
class MXFP4:
    """A weight kept as FP4 e2m1 codes, two per byte along K, with one E8M0 scale per 32 along K.

    Model code passes it only as an `expert_ffn` weight ([E, N, K]: `weight` [E, N, K/2] uint8, `scale`
    [E, N, K/32]; DeepSeek ships only routed experts in FP4), only to backends whose Capabilities.weight_formats
    include "mxfp4"; the value it stands for is `dequantize()`.
    """

    weight: torch.Tensor  # uint8 [.., N, K/2]: element 2i in the low nibble of byte i
    scale: torch.Tensor  # float8_e8m0fnu [.., N, K/32]

    format = "mxfp4"

    @property
    def shape(self) -> torch.Size:
        """The shape of the weight it stands for: [.., N, K]."""
        return torch.Size((*self.weight.shape[:-1], self.weight.shape[-1] * 2))

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes

    def to(self, device: torch.device | str) -> MXFP4:
        return MXFP4(self.weight.to(device), self.scale.to(device))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """e2m1 value * 2^(scale - 127) per element, in float32 (exact), returned in `dtype`."""
        codes = torch.stack([self.weight & 0xF, self.weight >> 4], dim=-1).flatten(-2)  # [.., N, K]
        values = e2m1_values(codes).unflatten(-1, (-1, MX_BLOCK))  # [.., N, K/32, 32]
        return (values * self.scale.float()[..., None]).flatten(-2).to(dtype)

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> MXFP4:
        """Quantize a [.., N, K] weight (K a multiple of 32): per 32 along K the scale 2^ceil(log2(amax / 6)) (the
        smallest power of two under which no element clips; at least 2^-126), each element rounded to the nearest
        e2m1 value, ties to the even code."""
        _check_finite(weight, "mxfp4")
        if weight.shape[-1] % MX_BLOCK:
            raise ValueError(f"mxfp4 keeps one scale per {MX_BLOCK} along K; K = {weight.shape[-1]} is not a multiple")
        blocks = weight.float().unflatten(-1, (-1, MX_BLOCK))  # [.., N, K/32, 32]
        scale = pow2_ceil(blocks.abs().amax(dim=-1, keepdim=True).clamp_min(E2M1_MAX * 2**-126) * (1 / E2M1_MAX))
        codes = e2m1_codes((blocks / scale).clamp(-E2M1_MAX, E2M1_MAX)).flatten(-2)  # [.., N, K]
        return cls(codes[..., 0::2] | codes[..., 1::2] << 4, e8m0_from_pow2(scale[..., 0]))


QuantizedWeight = BlockFP8 | MXFP4
Weight = torch.Tensor | BlockFP8 | MXFP4


def weight_format(weight: Weight) -> str:
    """ "fp8_block", "mxfp4", or the dense tensor's dtype name ("bfloat16", ...)."""
    return weight.format if isinstance(weight, (BlockFP8, MXFP4)) else str(weight.dtype).removeprefix("torch.")


def weight_bytes(weights) -> dict[str, int]:
    """Bytes held by format ("mxfp4", "fp8_block" with their scales; dense tensors by dtype), largest first."""
    totals: dict[str, int] = {}
    for w in weights:
        nbytes = w.nbytes if isinstance(w, (BlockFP8, MXFP4)) else w.numel() * w.element_size()
        totals[weight_format(w)] = totals.get(weight_format(w), 0) + nbytes
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def dequantized(weight: Weight, dtype: torch.dtype) -> torch.Tensor:
    """The value a weight stands for in `dtype` (a dense tensor as it is)."""
    return weight.dequantize(dtype) if isinstance(weight, (BlockFP8, MXFP4)) else weight


def concat_rows(parts: list[Weight], dtype: torch.dtype) -> Weight:
    """Stack weights along N (gate | up): one quantized weight when every part is one of the same format (FP8
    blocks: of the same block, the parts before the last of whole row blocks), else the dequantized
    concatenation in `dtype`."""
    if all(isinstance(p, MXFP4) for p in parts):
        return MXFP4(torch.cat([p.weight for p in parts], dim=-2), torch.cat([p.scale for p in parts], dim=-2))
    fp8 = all(isinstance(p, BlockFP8) for p in parts) and len({(p.block, p.scale.dtype) for p in parts}) == 1
    if fp8 and all(p.shape[-2] % p.block[0] == 0 for p in parts[:-1]):
        weight = torch.cat([p.weight for p in parts], dim=-2)
        return BlockFP8(weight, torch.cat([p.scale for p in parts], dim=-2), parts[0].block)
    return torch.cat([dequantized(p, dtype) for p in parts], dim=-2)


def stack(parts: list[Weight], dtype: torch.dtype) -> Weight:
    """Stack per-expert weights along a new leading dim: one quantized weight when all are of one format (and
    FP8 block and scale dtype), else the dequantized stack in `dtype`."""
    if all(isinstance(p, MXFP4) for p in parts):
        return MXFP4(torch.stack([p.weight for p in parts]), torch.stack([p.scale for p in parts]))
    if all(isinstance(p, BlockFP8) for p in parts) and len({(p.block, p.scale.dtype) for p in parts}) == 1:
        return BlockFP8(torch.stack([p.weight for p in parts]), torch.stack([p.scale for p in parts]), parts[0].block)
    return torch.stack([dequantized(p, dtype) for p in parts])
