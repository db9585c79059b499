"""The compute dtype (`dtype="auto"` as vLLM means it) and the KV-cache dtype an LLM asks of its backend."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from deepinfer_core.backend.types import BackendInfo, Capabilities
from deepinfer_core.errors import BackendSelectionError, DeepInferError

__all__ = ["DTYPE_NAMES", "KV_DTYPE_NAMES", "check_kv_cache_dtype", "choose_dtype", "parse_dtype"]

log = logging.getLogger(__name__)
DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}
KV_DTYPE_NAMES: dict[str, torch.dtype] = {
    **DTYPE_NAMES,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "float8_e5m2": torch.float8_e5m2,
}
_STORED: dict[str, torch.dtype] = {**KV_DTYPE_NAMES, "float64": torch.float64}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(value: str | torch.dtype, field: str = "dtype", names: Mapping[str, torch.dtype] = DTYPE_NAMES):
    """The torch dtype a `dtype` / `kv_cache_dtype` value names, or None for "auto"."""
    if isinstance(value, torch.dtype):
        if value in names.values():
            return value
        value = _name(value)
    elif isinstance(value, str) and value.strip().lower() == "auto":
        return None
    key = value.strip().lower() if isinstance(value, str) else value
    if key not in names:
        raise DeepInferError(f"{field} {value!r} is not one of auto, {', '.join(names)}")
    return names[key]


def _checkpoint_dtype(config: Mapping[str, Any]) -> tuple[torch.dtype, bool]:
    """(the dtype config.json says the weights are stored in, whether they are FP8-quantized); float32 when
    config.json does not say, as transformers assumes."""
    stored = _STORED.get(str(config.get("torch_dtype") or config.get("dtype") or "float32"), torch.float32)
    quant = config.get("quantization_config") or {}
    fp8 = stored.itemsize == 1 or (isinstance(quant, Mapping) and quant.get("quant_method") == "fp8")
    return stored, fp8


def choose_dtype(
    requested: torch.dtype | None, info: BackendInfo, capabilities: Capabilities, config: Mapping[str, Any]
) -> torch.dtype:
    """The compute dtype on this backend. requested None ("auto"): bfloat16 on an accelerator (device_kind
    other than "cpu") for a 16-bit or FP8 checkpoint, else the checkpoint's dtype; the nearest dtype the
    backend computes in when it lacks that one (logged). A dtype asked for by name is checked when the
    backend is resolved."""
    if requested is not None:
        return requested
    stored, fp8 = _checkpoint_dtype(config)
    if fp8 or (stored.itemsize <= 2 and info.device_kind != "cpu"):
        wanted = torch.bfloat16
    else:  # float64 checkpoints compute in float32
        wanted = stored if stored in DTYPE_NAMES.values() else torch.float32
    order = [torch.bfloat16, torch.float16, torch.float32] if wanted.itemsize <= 2 else [torch.float32, torch.bfloat16]
    for dtype in [wanted, *order]:
        if _name(dtype) in capabilities.dtypes:
            if dtype != wanted:
                log.warning(
                    "dtype auto: backend %s does not compute in %s; using %s", info.name, _name(wanted), _name(dtype)
                )
            return dtype
    raise BackendSelectionError(
        f"dtype auto: backend {info.name} computes in {', '.join(capabilities.dtypes)}, none of which DeepInfer "
        f"runs models in ({', '.join(_name(d) for d in order)}); pick another accelerator"
    )


def check_kv_cache_dtype(
    value: str | torch.dtype, info: BackendInfo, capabilities: Capabilities, compute_dtype: torch.dtype
) -> None:
    """Refuse a kv_cache_dtype the backend cannot store, or one the model cannot use. "auto" is the compute dtype."""
    wanted = parse_dtype(value, "kv_cache_dtype", KV_DTYPE_NAMES)
    if wanted is None or wanted == compute_dtype:
        return
    supported = capabilities.kv_dtypes or capabilities.dtypes
    if _name(wanted) not in supported:
        raise BackendSelectionError(
            f"kv_cache_dtype {value!r}: backend {info.name} does not store the KV cache in {_name(wanted)}; it "
            f"stores {', '.join(supported)} (kv_cache_dtype='auto' stores it in the model dtype, "
            f"{_name(compute_dtype)})"
        )
    raise DeepInferError(
        f"kv_cache_dtype {value!r}: the models store their KV cache in the compute dtype "
        f"({_name(compute_dtype)}), DeepSeek-V4.1 in its own FP8 / FP4 formats where the backend declares them "
        f"(Capabilities.kv_formats; no flag needed); pass kv_cache_dtype='auto', or dtype={_name(wanted)!r} to "
        f"compute in {_name(wanted)} too"
    )
