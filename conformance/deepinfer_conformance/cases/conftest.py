"""Shared fixtures for the engine-level cases: tiny random DeepSeek-V3 and -V4 checkpoints written with safetensors.

Written here (not borrowed from DeepInfer's tests/) so the suite needs neither transformers nor the
project's test tree. Weights are scaled so activations stay O(1) and the logits are clearly peaked.
"""

from __future__ import annotations

import json

import pytest

from deepinfer_conformance.tiny_v3 import TINY_V3, write_tiny_v3
from deepinfer_conformance.tiny_v4 import write_tiny_v4


@pytest.fixture(scope="session")
def tiny_v3(tmp_path_factory):
    """tiny_v3(q_lora_rank=None) -> folder of a tiny DeepSeek-V3 checkpoint (config.json +
    model.safetensors, random weights, no tokenizer); one per q_lora_rank, written once per session."""
    made = {}

    def make(q_lora_rank: int | None = None):
        if q_lora_rank not in made:
            path = tmp_path_factory.mktemp(f"tiny-v3-q{q_lora_rank or 'none'}")
            made[q_lora_rank] = write_tiny_v3(path, q_lora_rank)
        return made[q_lora_rank]

    return make


@pytest.fixture(scope="session")
def tiny_v3_fp8(tiny_v3, tmp_path_factory):
    """The tiny checkpoint (q_lora_rank 32) in DeepSeek's FP8 format: every 2-D `*_proj` weight stored as
    float8_e4m3fn with a float32 `_scale_inv` per 128 x 128 block, and a quantization_config."""
    from safetensors.torch import load_file, save_file

    from deepinfer_core.backend.ops import BlockFP8

    source = tiny_v3(32)
    tensors = {}
    for name, tensor in load_file(str(source / "model.safetensors")).items():
        if tensor.dim() == 2 and name.endswith(("_proj.weight", "_proj_with_mqa.weight")):
            quantized = BlockFP8.quantize(tensor)
            tensors[name], tensors[name + "_scale_inv"] = quantized.weight, quantized.scale
        else:
            tensors[name] = tensor
    path = tmp_path_factory.mktemp("tiny-v3-fp8")
    save_file(tensors, str(path / "model.safetensors"))
    raw = dict(TINY_V3, q_lora_rank=32, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    (path / "config.json").write_text(json.dumps(raw))
    return path


@pytest.fixture(scope="session")
def tiny_v4(tmp_path_factory):
    """Folder of a tiny DeepSeek-V4 checkpoint (config.json + model.safetensors, random weights): sliding,
    CSA and HCA layers, hash and top-k MoE, hyper-connections; written once per session."""
    return write_tiny_v4(tmp_path_factory.mktemp("tiny-v4"))


@pytest.fixture(scope="session")
def native_checkpoint(tmp_path_factory):
    """native_checkpoint("v4" | "v41") -> (folder of the tiny model in DeepSeek's native layout and formats: FP4
    experts, E8M0 FP8 projections, V4.1's FP8 Engram tables; folder of its float twin), written by DeepInfer's
    own quantizer (model/native_export.py) once per session."""
    made = {}

    def make(family: str):
        if family not in made:
            from deepinfer_conformance.tiny_v4 import TINY_V4, tiny_v4_weights
            from deepinfer_conformance.tiny_v41 import tiny_v41_config, tiny_v41_weights, write_tokenizer
            from deepinfer_core.model.native_export import write_float_twin, write_native

            root = tmp_path_factory.mktemp(f"native-{family}")
            if family == "v4":
                raw, weights = TINY_V4, tiny_v4_weights()
            else:
                raw = tiny_v41_config(write_tokenizer(root / "native"))
                weights = tiny_v41_weights(raw)
                write_tokenizer(root / "twin")
            twin = write_native(root / "native", raw, weights, family)
            made[family] = root / "native", write_float_twin(root / "twin", raw, twin)
        return made[family]

    return make
