"""Write a DeepSeek-V4 / V4.1 checkpoint in DeepSeek's native layout and formats, from float weights under our
names: the shape of the released V4 Flash / V4.1 Flash files, at any size (tests, the conformance suite).

- Names: native (no `model.` prefix, `embed`, `head`, `hc_head_fn`, V4's `attn.kv_norm`; v4_names / v41_names).
- Routed experts: MXFP4, stored as released: int8 [N, K/2] (two e2m1 values a byte) with `<stem>.scale` E8M0
  [N, K/32].
- Projections DeepSeek ships in FP8 (attention's wq_a / wq_b / wkv / wo_a / wo_b, the indexer's wq_b, shared
  experts, V4.1's engram.wkv, MTP's e_proj / h_proj): float8_e4m3fn with `<stem>.scale` E8M0 per block (the
  config's weight_block_size, ue8m0's rule: 2^ceil(log2(amax / 448))).
- V4.1's Engram tables: float8_e4m3fn with E8M0 scales per 32 channels of each row ([rows, head_dim / 32]).
- Everything else (embeddings, head, norms, routers, mixers, compressors) as given.
- config.json: quantization_config {quant_method fp8, fmt e4m3, scale_fmt ue8m0, weight_block_size}, and
  expert_dtype "fp4" where each release keeps it (V4: top level; V4.1: inside quantization_config).

`write_native` returns the weights the checkpoint stands for (every quantized tensor dequantized, float32): a
float twin of the same model, which `write_float_twin` writes under our names without quantization_config.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from deepinfer_core.backend.weight_formats import MXFP4, BlockFP8
from deepinfer_core.model.v4_names import v4_native_name
from deepinfer_core.model.v41_names import native_name as v41_native_name

__all__ = ["FP4_EXPERTS", "FP8_PROJECTIONS", "write_float_twin", "write_native"]

FP4_EXPERTS = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
FP8_PROJECTIONS = re.compile(
    r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|\.ffn\.shared_experts\.w[123]|\.engram\.wkv|\.[eh]_proj)\.weight$"
)
ENGRAM_TABLE = re.compile(r"\.engram\.embed\.weight$")
ENGRAM_BLOCK = (1, 32)  # one scale per 32 channels of a row


def _quantized_config(raw: Mapping[str, Any], family: str, block: int) -> dict[str, Any]:
    quant = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "scale_fmt": "ue8m0",
        "weight_block_size": [block, block],
    }
    if family == "v41":
        return {**raw, "quantization_config": {**quant, "expert_dtype": "fp4"}}
    return {**raw, "quantization_config": quant, "expert_dtype": "fp4"}


def write_native(
    folder: Path,
    raw_config: Mapping[str, Any],
    weights: Mapping[str, torch.Tensor],
    family: Literal["v4", "v41"],
    block: int | None = None,
) -> dict[str, torch.Tensor]:
    """Write config.json and model.safetensors of `weights` (our names) in DeepSeek's native layout into `folder`;
    FP8 blocks of `block` (default: the release's, 128 for V4 and 32 for V4.1). Returns the float twin's weights."""
    from safetensors.torch import save_file

    block = block or (128 if family == "v4" else 32)
    native = v4_native_name if family == "v4" else v41_native_name
    stored: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        key = native(name)
        stem = key.removesuffix(".weight")
        if FP4_EXPERTS.search(name):
            quantized = MXFP4.quantize(tensor)
            stored[key], stored[stem + ".scale"] = quantized.weight.view(torch.int8), quantized.scale
        elif FP8_PROJECTIONS.search(name) or ENGRAM_TABLE.search(name):
            blocks = ENGRAM_BLOCK if ENGRAM_TABLE.search(name) else (block, block)
            quantized = BlockFP8.quantize(tensor, blocks, scales="e8m0")
            stored[key], stored[stem + ".scale"] = quantized.weight, quantized.scale
        else:
            stored[key], twin[name] = tensor, tensor
            continue
        twin[name] = quantized.dequantize(torch.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: t.contiguous() for k, t in stored.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(_quantized_config(raw_config, family, block), indent=1))
    return twin


def write_float_twin(folder: Path, raw_config: Mapping[str, Any], twin: Mapping[str, torch.Tensor]) -> Path:
    """The float checkpoint (our names, no quantization_config) of the weights `write_native` returned."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: t.contiguous() for k, t in twin.items()}, str(folder / "model.safetensors"))
    raw = {k: v for k, v in raw_config.items() if k not in ("quantization_config", "expert_dtype")}
    (folder / "config.json").write_text(json.dumps(raw, indent=1))
    return folder
