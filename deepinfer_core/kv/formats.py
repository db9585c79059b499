"""Block formats: how DeepSeek-V4.1 keeps a vector as blocks of small elements under one scale per block, as
the values `round_to_format` gives (`round_blocks`) and as the bytes a KV layout may store (`pack`, `unpack`).

A format is "<element>/<scale>:<block length>":
  fp8_e4m3/pow2:32   float8 e4m3 elements; per 32, a power of two 2^ceil(log2(max(amax, 1e-4) / 448))
  fp4_e2m1/pow2:32   FP4 e2m1 elements; per 32, a power of two 2^ceil(log2(max(amax, 6 * 2^-126) / 6))
  fp4_e2m1/e4m3:16   FP4 e2m1 elements; per 16, the e4m3 rounding of max(amax, 6 * 2^-9) / 6
An element is the block's value / scale, clamped to the element's range and rounded to nearest, ties to even
(e2m1's magnitudes by code: 0, .5, 1, 1.5, 2, 3, 4, 6). The value kept is element * scale in float32, then cast
to the tensor's dtype (exact in bfloat16: at most 6 significant bits).

Packed, a vector of D values is one row of bytes: the element codes (D bytes for e4m3; D / 2 for e2m1, element
2i in the low nibble of byte i and 2i + 1 in the high one; e2m1's code is its sign bit, then the magnitude's
index), then D / block scale bytes (pow2: the float32 exponent field, e8m0; e4m3: the float8 byte). A row of
zero bytes unpacks to zeros.

Packing values that are already in the format gives them back exactly on unpacking (`pack` picks a scale they
lie on), though not always under the scale they were rounded with:
- pow2 scales: when a block's largest element rounded down to a power of two, the amax rule picks a scale half
  as big; every element times two is still in the format (e4m3's and e2m1's grids are closed under doubling
  below their maximum), so nothing rounds.
- e4m3 scales: with a normal scale (relative error <= 1/16) the largest element rounds to 6, so the rule gives
  the scale back. A subnormal one (k x 2^-9) rounds coarser: for k = 2 or 3 the largest element may round to
  4, where the rule would pick a smaller scale; `pack` then takes amax / 4, the scale they were rounded with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "BLOCK_FORMATS",
    "BlockFormat",
    "e2m1_codes",
    "e2m1_values",
    "pack",
    "pow2_ceil",
    "round_blocks",
    "round_e2m1",
    "unpack",
]

# The block formats `round_to_format` rounds to and a KV layout may store caches in.
BLOCK_FORMATS = ("fp8_e4m3/pow2:32", "fp4_e2m1/pow2:32", "fp4_e2m1/e4m3:16")
E4M3_MAX, E2M1_MAX = 448.0, 6.0


@dataclass(frozen=True, slots=True)
class BlockFormat:
    name: str
    element_bits: int  # 8 (e4m3) or 4 (e2m1)
    pow2_scale: bool  # the scale is a power of two (an e8m0 byte); else an e4m3 byte
    block: int

    @classmethod
    def of(cls, name: str) -> BlockFormat:
        """The format named `name`; ValueError naming the known ones for any other."""
        if name not in BLOCK_FORMATS:
            raise ValueError(f"unknown block format {name!r}; the block formats are {', '.join(BLOCK_FORMATS)}")
        element, scale = name.split("/")
        return cls(name, 8 if element == "fp8_e4m3" else 4, scale.startswith("pow2"), int(scale.split(":")[1]))

    def code_bytes(self, dim: int) -> int:
        """Bytes of a `dim`-vector's element codes (the scales follow them)."""
        return dim * self.element_bits // 8

    def row_bytes(self, dim: int) -> int:
        """Bytes of a packed `dim`-vector: codes, then one scale byte per block."""
        return self.code_bytes(dim) + dim // self.block

    def check_dim(self, dim: int) -> None:
        if dim % self.block or dim % 2:
            raise ValueError(
                f"{self.name} stores blocks of {self.block} along the last dim, which is {dim} here: "
                f"it needs a multiple of {self.block}"
            )


def pow2_ceil(t: torch.Tensor) -> torch.Tensor:
    """2^(e - 127 + (m != 0)) from the float32 bits of t >= 0 (exponent field e, mantissa field m):
    2^ceil(log2 t) for normal t, computed from the bits so no log rounds."""
    bits = t.float().view(torch.int32)
    power = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return ((power + 127) << 23).view(torch.float32)  # the float32 with exponent `power`, mantissa 0


def _e2m1_index(q: torch.Tensor) -> torch.Tensor:
    """The index (0..7) of |q|'s nearest e2m1 magnitude, q in [-6, 6], ties to the even index: the boundaries
    passed, where a tie goes down at 0.25, 1.25, 2.5, 5 (to 0, 2, 4, 6) and up at 0.75, 1.75, 3.5 (to 2, 4, 6)."""
    a = q.abs()
    return sum((a > b).to(torch.uint8) for b in (0.25, 1.25, 2.5, 5.0)) + sum(
        (a >= b).to(torch.uint8) for b in (0.75, 1.75, 3.5)
    )


def _e2m1_magnitude(index: torch.Tensor) -> torch.Tensor:
    """e2m1's magnitude by index, float32, in arithmetic (no host table: device graphs capture this):
    index / 2 below 4, index - 2 from 4 to 6, then 6."""
    i = index.float()
    return torch.where(i < 4, i * 0.5, torch.where(i < 7, i - 2.0, 6.0))


def e2m1_codes(q: torch.Tensor) -> torch.Tensor:
    """q in [-6, 6] -> the uint8 code (0..15) of its nearest e2m1 value, ties to the even code: the sign bit (8)
    only on a non-zero result, then the magnitude's index."""
    index = _e2m1_index(q)
    return index | ((q < 0) & (index > 0)).to(torch.uint8) << 3


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (0..15, any integer dtype) -> their values, float32 (code 8 is -0.0)."""
    magnitude = _e2m1_magnitude(codes & 7)
    return torch.where(codes >= 8, -magnitude, magnitude)


def round_e2m1(q: torch.Tensor) -> torch.Tensor:
    """q in [-6, 6] to the nearest FP4 e2m1 value (ties to the even code), in q's dtype; a zero result is +0."""
    magnitude = _e2m1_magnitude(_e2m1_index(q)).to(q.dtype)
    return torch.where((q < 0) & (magnitude > 0), -magnitude, magnitude)


def _scales(fmt: BlockFormat, blocks: torch.Tensor) -> torch.Tensor:
    """Each block's scale [..., B, 1] float32, from blocks [..., B, block] float32."""
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    if fmt.element_bits == 8:
        return pow2_ceil(amax.clamp_min(1e-4) * (1 / E4M3_MAX))
    if fmt.pow2_scale:
        return pow2_ceil(amax.clamp_min(E2M1_MAX * 2**-126) * (1 / E2M1_MAX))
    return (amax.clamp_min(E2M1_MAX * 2**-9) / E2M1_MAX).to(torch.float8_e4m3fn).float()


def _blocks(x: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    fmt.check_dim(x.shape[-1])
    return x.float().unflatten(-1, (-1, fmt.block))  # [..., D / block, block]


def round_blocks(x: torch.Tensor, name: str) -> torch.Tensor:
    """x [..., D] as kept in format `name`, in x's dtype (round_to_format's definition)."""
    fmt = BlockFormat.of(name)
    blocks = _blocks(x, fmt)
    scale = _scales(fmt, blocks)
    if fmt.element_bits == 8:
        q = (blocks / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    else:
        q = round_e2m1((blocks / scale).clamp(-E2M1_MAX, E2M1_MAX))
    return (q * scale).flatten(-2).to(x.dtype)


def _holds(blocks: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[..., B, 1]: whether each block of e2m1 values is exactly elements x its scale."""
    q = round_e2m1((blocks / scale).clamp(-E2M1_MAX, E2M1_MAX))
    return (q * scale == blocks).all(dim=-1, keepdim=True)


def pack(x: torch.Tensor, name: str) -> torch.Tensor:
    """x [N, D] -> its packed rows [N, row_bytes(D)] uint8: x itself where x is in format `name` (as
    `round_blocks` leaves it), otherwise x rounded to it on the way."""
    fmt = BlockFormat.of(name)
    blocks = _blocks(x, fmt)  # [N, D / block, block]
    scale = _scales(fmt, blocks)
    if not fmt.pow2_scale:  # amax / 4 where the rule's scale does not hold the block and that one does
        quarter = blocks.abs().amax(dim=-1, keepdim=True) / 4
        quarter_fits = _holds(blocks, quarter) & (quarter.to(torch.float8_e4m3fn).float() == quarter)
        scale = torch.where(quarter_fits & ~_holds(blocks, scale), quarter, scale)
    if fmt.element_bits == 8:
        codes = (blocks / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8).flatten(1)
    else:
        q = (blocks / scale).clamp(-E2M1_MAX, E2M1_MAX).flatten(1)  # [N, D]
        nibbles = e2m1_codes(q)
        codes = nibbles[:, 0::2] | nibbles[:, 1::2] << 4
    if fmt.pow2_scale:
        scale_bytes = ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)  # e8m0: the exponent field
    else:
        scale_bytes = scale.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([codes, scale_bytes.flatten(1)], dim=1)


def unpack(rows: torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor:
    """Packed rows [N, row_bytes(D)] uint8 of format `name` -> the values [N, D] in `dtype`."""
    fmt = BlockFormat.of(name)
    dim = rows.shape[1] * fmt.block * 8 // (fmt.element_bits * fmt.block + 8)
    codes, scale_bytes = rows[:, : fmt.code_bytes(dim)], rows[:, fmt.code_bytes(dim) :]
    if fmt.element_bits == 8:
        q = codes.contiguous().view(torch.float8_e4m3fn).float()
    else:
        q = e2m1_values(torch.stack([codes & 0xF, codes >> 4], dim=2).flatten(1))  # [N, D]
    if fmt.pow2_scale:
        scale = (scale_bytes.to(torch.int32) << 23).view(torch.float32)
    else:
        scale = scale_bytes.contiguous().view(torch.float8_e4m3fn).float()
    return (q.unflatten(1, (-1, fmt.block)) * scale[:, :, None]).flatten(1).to(dtype)
