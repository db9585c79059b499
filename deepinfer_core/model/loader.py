"""Read a Hugging Face-format checkpoint: config.json, safetensors (single or sharded), FP8 block scales.

DeepSeek's official FP8 checkpoints store `W` as float8_e4m3fn with `W_scale_inv` holding one float32
multiplier per [128, 128] block. Tensors the caller names in `keep_fp8` stay in that format (as
ops.BlockFP8) for backends that compute with it; every other FP8 tensor is dequantized here (W * scale).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from deepinfer_core.backend.ops import BlockFP8
from deepinfer_core.errors import DeepInferError

__all__ = ["CheckpointError", "dequantize_fp8_blocks", "load_tensors", "read_config"]

log = logging.getLogger(__name__)
INDEX_FILE = "model.safetensors.index.json"
_UNSUPPORTED_FP8 = (torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


class CheckpointError(DeepInferError):
    """The checkpoint on disk is missing something or holds something of the wrong shape."""


def read_config(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise CheckpointError(f"model path {path} is not a directory (expected a Hugging Face checkpoint folder)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"no config.json in {path}: is this a Hugging Face-format checkpoint?")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{config_file} is not valid JSON: {err}") from None


def _tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name -> file holding it."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing:
            raise CheckpointError(f"{INDEX_FILE} in {path} names shard(s) that are not there: {', '.join(missing)}")
        return {name: path / file for name, file in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    names = {}
    for file in files:
        with safe_open(file, "pt") as f:
            names.update(dict.fromkeys(f.keys(), file))
    return names


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [N, K] float8 with scale_inv [ceil(N/bn), ceil(K/bk)] -> float32 [N, K] = weight * scale."""
    return BlockFP8(weight, scale_inv, block).dequantize(torch.float32)


def _fp8_block(config: Mapping[str, Any]) -> tuple[int, int] | None:
    quant = config.get("quantization_config")
    if not quant:
        return None
    if quant.get("quant_method") != "fp8":
        raise CheckpointError(f"quantization method {quant.get('quant_method')!r} is not supported (supported: fp8)")
    block = quant.get("weight_block_size") or [128, 128]
    return int(block[0]), int(block[1])


def _check_shape(name: str, file: Path, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise CheckpointError(
            f"tensor {name} in {file.name} has shape {tuple(tensor.shape)}, but the config implies {tuple(shape)}"
        )


def load_tensors(
    path: Path,
    config: Mapping[str, Any],
    expected: Mapping[str, tuple[int, ...]],
    dtype: torch.dtype,
    keep_float32: re.Pattern[str] | None = None,
    progress: bool = True,
    keep_fp8: re.Pattern[str] | None = None,
) -> dict[str, torch.Tensor | BlockFP8]:
    """Load exactly the tensors in `expected` (name -> shape), checking each shape, cast to `dtype`
    (names matching `keep_float32` stay float32; FP8 tensors matching `keep_fp8` stay FP8, as BlockFP8).
    Extra tensors in the checkpoint are skipped."""
    files = _tensor_files(path)
    missing = [name for name in expected if name not in files]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"checkpoint {path} is missing {len(missing)} tensor(s) the model needs: {shown}")
    block = _fp8_block(config)
    tensors: dict[str, torch.Tensor] = {}
    bar = tqdm(total=len(expected), desc="Loading weights", unit="tensor", disable=not progress, leave=False)
    with ExitStack() as stack:
        opened: dict[Path, Any] = {}

        def handle(file: Path):  # each shard is opened once for the whole load
            if file not in opened:
                opened[file] = stack.enter_context(safe_open(file, "pt"))
            return opened[file]

        for name, shape in expected.items():
            tensor = handle(files[name]).get_tensor(name)
            if tensor.dtype in _UNSUPPORTED_FP8:
                raise CheckpointError(f"tensor {name} is {tensor.dtype}; only float8_e4m3fn weights are supported")
            if tensor.dtype == torch.float8_e4m3fn:
                scale_name = name + "_scale_inv"
                if block is None or scale_name not in files:
                    raise CheckpointError(f"tensor {name} is FP8 but {scale_name} / quantization_config is missing")
                scale = handle(files[scale_name]).get_tensor(scale_name)
                if keep_fp8 is not None and keep_fp8.search(name):
                    _check_shape(name, files[name], tensor, shape)
                    tensors[name] = BlockFP8(tensor, scale.float(), block)
                    bar.update()
                    continue
                tensor = dequantize_fp8_blocks(tensor, scale, block)
            _check_shape(name, files[name], tensor, shape)
            if not tensor.is_floating_point():  # integer tables (V4's tid2eid) stay as stored
                tensors[name] = tensor
                bar.update()
                continue
            keep = keep_float32 is not None and keep_float32.search(name)
            tensors[name] = tensor.to(torch.float32 if keep else dtype)
            bar.update()
    bar.close()
    unused = [n for n in files if n not in expected and not n.endswith("_scale_inv")]
    if unused:
        log.debug("skipped %d checkpoint tensors the model does not use (e.g. %s)", len(unused), unused[0])
    return tensors
