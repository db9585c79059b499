"""Reading the quantized tensors of DeepSeek's checkpoints into ops.BlockFP8 / ops.MXFP4, or refusing them clearly.

What a checkpoint may hold (see backend/weight_formats.py for the formats):
- FP8 e4m3 weights [N, K] with block scales [ceil(N/bn), ceil(K/bk)] named `<name>_scale_inv` (transformers,
  float32) or `<stem>.scale` for `<stem>.weight` (DeepSeek-native, E8M0 bytes: torch.float8_e8m0fnu, or uint8
  where `scale_fmt` is ue8m0; V4 Flash-Base: float32 powers of two). The block comes from quantization_config's
  `weight_block_size` (128 x 128 in V3 / V4, 32 x 32 in V4.1); a scale of another shape that divides the weight
  evenly names its own block (V4.1's Engram tables: [rows, 256] with [rows, 8], per 32 channels).
- FP4 e2m1 routed experts (`expert_dtype: fp4`, top-level in V4, in quantization_config in V4.1): [N, K/2] int8
  (as released), uint8 or float4_e2m1fn_x2, two values per byte, with `<stem>.scale` [N, K/32] E8M0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_core.backend.weight_formats import MX_BLOCK, MXFP4, BlockFP8
from deepinfer_core.errors import CheckpointError

__all__ = ["Quantization", "is_quantized", "read_quantized", "scale_names"]

E8M0 = torch.float8_e8m0fnu
FP4_STORAGE = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)  # dtypes packed e2m1 pairs are stored in
_KNOWN = {"quant_method": ("fp8",), "fmt": ("e4m3",), "scale_fmt": ("ue8m0",), "expert_dtype": ("fp4", "fp8", "bf16")}


@dataclass(frozen=True, slots=True)
class Quantization:
    """What config.json says about the checkpoint's quantized tensors."""

    block: tuple[int, int] | None  # FP8 block (bn, bk); None: the config declares no quantization
    pow2_scales: bool  # scale_fmt ue8m0: FP8 scales are powers of two (uint8 scale bytes are E8M0)
    expert_dtype: str | None  # "fp4": routed experts are MXFP4

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> Quantization:
        """From a config.json (quantization_config at its top, or hoisted into V4.1's text fields); a
        CheckpointError naming the key for any method or format DeepInfer does not read."""
        quant = config.get("quantization_config") or {}
        expert_dtype = quant.get("expert_dtype", config.get("expert_dtype"))
        for key, value in (
            *((k, quant.get(k)) for k in ("quant_method", "fmt", "scale_fmt")),
            ("expert_dtype", expert_dtype),
        ):
            if value is not None and value not in _KNOWN[key]:
                raise CheckpointError(
                    f"config.json has {key} {value!r}, a quantization DeepInfer does not read (it reads "
                    f"{key} {' or '.join(map(repr, _KNOWN[key]))}): use a checkpoint in DeepSeek's FP8 / FP4 "
                    "formats or in bfloat16"
                )
        block = quant.get("weight_block_size") or ([128, 128] if quant else None)
        return cls(
            block=(int(block[0]), int(block[1])) if block else None,
            pow2_scales=quant.get("scale_fmt") == "ue8m0",
            expert_dtype=expert_dtype,
        )


def scale_names(name: str) -> tuple[str, ...]:
    """Where a checkpoint keeps a quantized tensor's scales: `<name>_scale_inv`, or `<stem>.scale`."""
    native = (name.removesuffix(".weight") + ".scale",) if name.endswith(".weight") else (name + ".scale",)
    return (name + "_scale_inv", *native)


def is_quantized(tensor: torch.Tensor) -> bool:
    """Whether a stored tensor is FP8 or packed FP4, read only with its scales (DeepSeek's models hold no other
    8-bit tensors; V4's hash table tid2eid is int64)."""
    return tensor.dtype == torch.float8_e4m3fn or tensor.dtype in FP4_STORAGE


def read_quantized(
    name: str, tensor: torch.Tensor, scale: torch.Tensor | None, shape: Sequence[int], quant: Quantization
) -> BlockFP8 | MXFP4:
    """The stored tensor `name` (FP8 or packed FP4) with its `scale` as the weight of `shape` it stands for."""
    shape = tuple(shape)
    if scale is None:
        raise CheckpointError(
            f"tensor {name} is {_dtype(tensor)} {tuple(tensor.shape)} with no scales beside it (looked for "
            f"{' and '.join(scale_names(name))}): DeepInfer reads FP8 weights with block scales and FP4 (MXFP4) "
            "weights with E8M0 scales per 32; re-export the checkpoint with its scales, or in bfloat16"
        )
    if tensor.dtype == torch.float8_e4m3fn:
        _check(name, tensor.shape, shape, "shape")
        return BlockFP8(tensor, _fp8_scales(name, scale, quant), _block(name, shape, scale.shape, quant))
    packed = (*shape[:-1], shape[-1] // 2)
    if shape[-1] % MX_BLOCK or tuple(tensor.shape) != packed:
        raise CheckpointError(
            f"tensor {name} is {_dtype(tensor)} {tuple(tensor.shape)}: read as FP4 (two e2m1 values a byte) it "
            f"would have to be {packed} for the weight {shape} the config implies, with K a multiple of {MX_BLOCK}"
        )
    _check(name + " scales", scale.shape, (*shape[:-1], shape[-1] // MX_BLOCK), "shape (one per 32 along K)")
    return MXFP4(tensor.view(torch.uint8), _pow2_bytes(name, scale, "FP4 (MXFP4)"))


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _check(name: str, actual: Sequence[int], expected: tuple[int, ...], what: str) -> None:
    if tuple(actual) != expected:
        raise CheckpointError(f"tensor {name} has {what} {tuple(actual)}; the config implies {expected}")


def _block(name: str, shape: tuple[int, ...], scale_shape: Sequence[int], quant: Quantization) -> tuple[int, int]:
    """The FP8 block: the config's where the scales fit it, else the one the scales divide the weight into."""
    rows, cols = shape[-2:]
    s_rows, s_cols = tuple(scale_shape)[-2:]
    if quant.block is not None and (s_rows, s_cols) == (
        math.ceil(rows / quant.block[0]),
        math.ceil(cols / quant.block[1]),
    ):
        return quant.block
    if s_rows and s_cols and rows % s_rows == 0 and cols % s_cols == 0:
        return rows // s_rows, cols // s_cols
    if quant.block is None:
        raise CheckpointError(
            f"tensor {name} {shape} is FP8 but config.json has no quantization_config saying its block size, and its "
            f"scales {tuple(scale_shape)} do not divide it evenly: add the checkpoint's quantization_config "
            '(e.g. {"quant_method": "fp8", "weight_block_size": [128, 128]})'
        )
    raise CheckpointError(
        f"tensor {name} {shape} has FP8 scales {tuple(scale_shape)}, which match neither the config's "
        f"weight_block_size {list(quant.block)} nor whole blocks of the weight: the scales do not belong to this weight"
    )


def _fp8_scales(name: str, scale: torch.Tensor, quant: Quantization) -> torch.Tensor:
    if scale.dtype in (E8M0, torch.uint8):
        if scale.dtype == torch.uint8 and not quant.pow2_scales:
            raise CheckpointError(
                f"tensor {name}'s scales are uint8 but config.json's quantization_config has no scale_fmt 'ue8m0': "
                "DeepInfer reads byte scales only as E8M0 powers of two; add the key if that is what they are"
            )
        return _pow2_bytes(name, scale, "FP8")
    if scale.is_floating_point() and scale.element_size() >= 2:
        return scale.float()  # float32 (or 16-bit) multipliers
    raise CheckpointError(f"tensor {name}'s scales are {_dtype(scale)}; FP8 scales are float32 or E8M0")


def _pow2_bytes(name: str, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """E8M0 scales as torch.float8_e8m0fnu; float scales only where every one is a power of two."""
    if scale.dtype in (E8M0, torch.uint8):
        return scale.view(torch.uint8).view(E8M0)
    if scale.is_floating_point():
        as_bytes = ((scale.float().view(torch.int32) >> 23) & 0xFF).to(torch.uint8).view(E8M0)
        if torch.equal(as_bytes.float(), scale.float()):
            return as_bytes
    raise CheckpointError(
        f"tensor {name}'s scales are {_dtype(scale)} but {fmt} weights take E8M0 scales (powers of two, "
        "float8_e8m0fnu or uint8): the checkpoint's format is not one DeepInfer reads"
    )
