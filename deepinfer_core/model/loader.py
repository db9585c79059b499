"""Read a Hugging Face-format checkpoint: config.json, safetensors (single or sharded), quantized weights.

DeepSeek's checkpoints store most weights quantized: FP8 with block scales, routed experts of V4 / V4.1 in FP4
(model/quantized.py says how each is stored). A quantized tensor whose format is in the caller's
`keep_quantized` (format -> pattern of the names that stay in it; the backend's Capabilities.weight_formats
decide which formats the model asks for) stays in it, as ops.BlockFP8 / ops.MXFP4; every other one is
dequantized here. A model whose checkpoints come in several spellings passes `spellings`: where each tensor it
needs may be stored, under another name or as one slice of a stacked tensor.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from deepinfer_core.backend.weight_formats import MXFP4, BlockFP8, weight_bytes
from deepinfer_core.errors import CheckpointError
from deepinfer_core.model.quantized import Quantization, is_quantized, read_quantized, scale_names

__all__ = [
    "CheckpointError",
    "Spellings",
    "StoredTensor",
    "dequantize_fp8_blocks",
    "kept_formats",
    "load_tensors",
    "read_config",
]

log = logging.getLogger(__name__)
INDEX_FILE = "model.safetensors.index.json"
_UNSUPPORTED_FP8 = (torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """Where a checkpoint may keep a tensor the model needs: a stored name, or one slice of it (`index`,
    e.g. `(e, slice(0, I))` for expert e's rows of a stacked [E, 2I, D] tensor). A slice's `stacked_shape`
    is the whole stored tensor's, checked first: a stack of other sizes could still slice to the right shape."""

    name: str
    index: tuple[int | slice, ...] = ()
    stacked_shape: tuple[int, ...] | None = None

    def __str__(self) -> str:  # as in error messages: name[3, 0:16]
        if not self.index:
            return self.name
        parts = (f"{i.start or ''}:{i.stop or ''}" if isinstance(i, slice) else str(i) for i in self.index)
        return f"{self.name}[{', '.join(parts)}]"


# model tensor name -> the places a checkpoint may keep it, in order of preference
Spellings = Callable[[str], Sequence[StoredTensor]]


def _as_stored(name: str) -> Sequence[StoredTensor]:
    return (StoredTensor(name),)


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


def _check_shape(name: str, file: Path, actual: Sequence[int], shape: tuple[int, ...]) -> None:
    if tuple(actual) != tuple(shape):
        raise CheckpointError(
            f"tensor {name} in {file.name} has shape {tuple(actual)}, but the config implies {tuple(shape)}"
        )


def _locate(
    path: Path, expected: Mapping[str, Any], files: Mapping[str, Path], spellings: Spellings
) -> dict[str, StoredTensor]:
    """Model tensor name -> the first of its spellings the checkpoint holds. Names none of whose spellings
    are there are reported in the spelling most of the checkpoint's other tensors use."""
    found: dict[str, StoredTensor] = {}
    missing: list[Sequence[StoredTensor]] = []
    used: Counter[int] = Counter()  # which spelling (position in the list) the found tensors use
    for name in expected:
        options = spellings(name)
        hit = next((i for i, option in enumerate(options) if option.name in files), None)
        if hit is None:
            missing.append(options)
        else:
            found[name] = options[hit]
            used[hit] += 1
    if missing:
        usual = used.most_common(1)[0][0] if used else 0
        names = list(dict.fromkeys(options[min(usual, len(options) - 1)].name for options in missing))
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise CheckpointError(f"checkpoint {path} is missing {len(names)} tensor(s) the model needs: {shown}")
    return found


def _read(f: Any, stored: StoredTensor, file: Path) -> torch.Tensor:
    if not stored.index:
        return f.get_tensor(stored.name)
    whole = f.get_slice(stored.name)
    if stored.stacked_shape is not None:
        _check_shape(stored.name, file, whole.get_shape(), stored.stacked_shape)
    return whole[stored.index]  # reads only the slice, not the whole stacked tensor


def kept_formats(weight_formats: Collection[str], patterns: Mapping[str, re.Pattern[str]]) -> dict:
    """load_tensors' keep_quantized: of a model's format -> weight name patterns, those of the formats a backend
    takes (its Capabilities.weight_formats)."""
    return {fmt: pattern for fmt, pattern in patterns.items() if fmt in weight_formats}


def load_tensors(
    path: Path,
    config: Mapping[str, Any],
    expected: Mapping[str, tuple[int, ...]],
    dtype: torch.dtype,
    keep_float32: re.Pattern[str] | None = None,
    progress: bool = True,
    keep_quantized: Mapping[str, re.Pattern[str]] | None = None,
    spellings: Spellings | None = None,
) -> dict[str, torch.Tensor | BlockFP8 | MXFP4]:
    """Load exactly the tensors in `expected` (name -> shape), checking each shape, cast to `dtype`
    (names matching `keep_float32` stay float32; quantized tensors whose format `keep_quantized` maps to a
    pattern their name matches stay quantized). `spellings` says where the checkpoint may keep each (default:
    under that very name); the result is keyed by the model's names either way. Extra tensors are skipped."""
    files = _tensor_files(path)
    where = _locate(path, expected, files, spellings or _as_stored)
    quant = Quantization.of(config)
    keep_quantized = keep_quantized or {}
    tensors: dict[str, torch.Tensor | BlockFP8 | MXFP4] = {}
    bar = tqdm(total=len(expected), desc="Loading weights", unit="tensor", disable=not progress, leave=False)
    with ExitStack() as stack:
        opened: dict[Path, Any] = {}

        def handle(file: Path):  # each shard is opened once for the whole load
            if file not in opened:
                opened[file] = stack.enter_context(safe_open(file, "pt"))
            return opened[file]

        def scales_of(stored: StoredTensor) -> torch.Tensor | None:
            name = next((n for n in scale_names(stored.name) if n in files), None)
            return None if name is None else handle(files[name]).get_tensor(name)

        for name, shape in expected.items():
            stored = where[name]
            file = files[stored.name]
            tensor = _read(handle(file), stored, file)
            if tensor.dtype in _UNSUPPORTED_FP8:
                raise CheckpointError(f"tensor {stored} is {tensor.dtype}; only float8_e4m3fn weights are supported")
            if is_quantized(tensor):
                if stored.index:
                    raise CheckpointError(
                        f"tensor {stored.name} is a stack of quantized weights; quantized weights load only "
                        "unstacked (one tensor per weight, its scales beside it): convert the checkpoint or store "
                        "it in bf16"
                    )
                weight = read_quantized(str(stored), tensor, scales_of(stored), shape, quant)
                keep = keep_quantized.get(weight.format)
                if keep is not None and keep.search(name):
                    tensors[name] = weight
                else:
                    wide = keep_float32 is not None and keep_float32.search(name)
                    tensors[name] = weight.dequantize(torch.float32 if wide else dtype)
                bar.update()
                continue
            _check_shape(str(stored), file, tensor.shape, shape)
            if not tensor.is_floating_point():  # integer tables (V4's tid2eid) stay as stored
                tensors[name] = tensor
                bar.update()
                continue
            keep = keep_float32 is not None and keep_float32.search(name)
            tensors[name] = tensor.to(torch.float32 if keep else dtype)
            bar.update()
    bar.close()
    sizes = ", ".join(f"{_size(n)} {fmt}" for fmt, n in weight_bytes(tensors.values()).items())
    log.info("weights read from %s: %s", path, sizes or "none")
    read = {stored.name for stored in where.values()}
    unused = [n for n in files if n not in read and not n.endswith(("_scale_inv", ".scale"))]
    if unused:
        log.debug("skipped %d checkpoint tensors the model does not use (e.g. %s)", len(unused), unused[0])
    return tensors


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"
