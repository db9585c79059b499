"""Shared fixtures for the engine-level cases: tiny random DeepSeek-V3 and -V4 checkpoints written with safetensors.

Written here (not borrowed from DeepInfer's tests/) so the suite needs neither transformers nor the
project's test tree. Weights are scaled so activations stay O(1) and the logits are clearly peaked.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from deepinfer_conformance.tiny_v4 import write_tiny_v4

TINY_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,  # layer 0 dense, layers 1-2 MoE
    "num_attention_heads": 2,
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "n_shared_experts": 1,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "eos_token_id": 1,
}


def _tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    noise = torch.randn(shape, generator=generator)
    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        return 1.0 + 0.1 * noise
    if name.endswith("e_score_correction_bias"):
        return 0.5 * noise  # non-zero: routing must pick by corrected score, weight by raw score
    if name == "model.embed_tokens.weight":
        return noise
    if name == "lm_head.weight":
        return noise * (4.0 / math.sqrt(shape[1]))  # logits std ~4 over a normalised hidden state
    return noise * (1.0 / math.sqrt(shape[1]))  # [out, in] projections: unit gain


@pytest.fixture(scope="session")
def tiny_v3(tmp_path_factory):
    """tiny_v3(q_lora_rank=None) -> folder of a tiny DeepSeek-V3 checkpoint (config.json +
    model.safetensors, random weights, no tokenizer); one per q_lora_rank, written once per session."""
    from safetensors.torch import save_file

    from deepinfer_core.model.config import DeepseekConfig
    from deepinfer_core.model.deepseek_v3 import expected_weights

    made = {}

    def make(q_lora_rank: int | None = None):
        if q_lora_rank not in made:
            raw = dict(TINY_V3, q_lora_rank=q_lora_rank)
            path = tmp_path_factory.mktemp(f"tiny-v3-q{q_lora_rank or 'none'}")
            generator = torch.Generator().manual_seed(1234)
            shapes = expected_weights(DeepseekConfig.from_hf(raw))
            save_file(
                {n: _tensor(n, s, generator).contiguous() for n, s in shapes.items()}, str(path / "model.safetensors")
            )
            (path / "config.json").write_text(json.dumps(raw))
            made[q_lora_rank] = path
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
