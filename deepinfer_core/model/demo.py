"""The embedded demo model: DeepSeek-V3 architecture, deterministic random weights, the V4 tokenizer.

It exists so that `deepinfer generate` / `serve` work on a fresh machine with no checkpoint, and so
tests exercise the real path. Its output is meaningless: the weights are random.
"""

from __future__ import annotations

import torch

from deepinfer_core.backend.resolve import ResolvedBackend
from deepinfer_core.model.config import DeepseekConfig
from deepinfer_core.model.deepseek_v3 import FLOAT32_WEIGHTS, DeepseekV3Model, expected_weights

__all__ = ["DEMO_CONFIG", "DEMO_NAME", "demo_model"]

DEMO_NAME = "deepinfer-demo-deepseek-v3-random"
DEMO_SEED = 20261129
DEMO_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 129280,  # the DeepSeek-V4 tokenizer's vocabulary
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "max_position_embeddings": 8192,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def demo_weights(config: DeepseekConfig, seed: int = DEMO_SEED) -> dict[str, torch.Tensor]:
    """Deterministic random weights: N(0, 0.02) matrices, unit norms, small router biases."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_weights(config).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        elif name.endswith("e_score_correction_bias"):
            weights[name] = torch.randn(shape, generator=generator) * 0.01
        else:
            weights[name] = torch.randn(shape, generator=generator) * 0.02
    return weights


def demo_model(backend: ResolvedBackend) -> DeepseekV3Model:
    config = DeepseekConfig.from_hf(DEMO_CONFIG)
    weights = {
        name: t if FLOAT32_WEIGHTS.search(name) else t.to(backend.dtype) for name, t in demo_weights(config).items()
    }
    return DeepseekV3Model(config, weights, backend)
