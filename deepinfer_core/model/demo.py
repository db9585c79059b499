"""The embedded demo model: DeepSeek-V4 architecture, deterministic random weights, the V4 tokenizer.

It exists so that `deepinfer generate` / `serve` work on a fresh machine with no checkpoint, and so
tests exercise the real path. Its output is meaningless: the weights are random. The architecture is
V4 Flash's at a tiny size: every attention type (sliding window, CSA at rate 4, HCA at rate 32 with a
128-token window), hyper-connections with 4 streams, hash-routed then sqrtsoftplus-routed experts.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from deepinfer_core.backend.resolve import ResolvedBackend
from deepinfer_core.model.config_v4 import CSA, HCA, SLIDING, DeepseekV4Config
from deepinfer_core.model.config_v41 import DeepseekV41Config
from deepinfer_core.model.deepseek_v4 import FLOAT32_WEIGHTS_V4, DeepseekV4Model, expected_weights_v4
from deepinfer_core.model.deepseek_v41 import expected_weights_v41
from deepinfer_core.model.dspark import dspark_weight_shapes

__all__ = ["DEMO_CONFIG", "DEMO_NAME", "demo_model", "demo_weights_v41"]

DEMO_NAME = "deepinfer-demo-deepseek-v4-random"
DEMO_SEED = 20261129
DEMO_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "vocab_size": 129280,  # the DeepSeek-V4 tokenizer's vocabulary
    "hidden_size": 256,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "layer_types": [SLIDING, CSA, HCA, CSA],
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    "compress_rates": {CSA: 4, HCA: 32},  # V4 Flash: HCA 128; 32 divides every block size the backends use
    "sliding_window": 128,
    "num_attention_heads": 4,
    "head_dim": 128,
    "partial_rotary_factor": 0.125,  # 16 rope dims, V4 Flash's share
    "q_lora_rank": 128,
    "o_groups": 2,
    "o_lora_rank": 64,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 64,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "max_position_embeddings": 8192,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_parameters": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536},
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def demo_weights(config: DeepseekV4Config, seed: int = DEMO_SEED, progress: bool = False) -> dict[str, torch.Tensor]:
    """Deterministic random weights: N(0, 0.02) matrices and biases, unit norms and mixer scales, a
    random token -> experts table for the hash-routed layers. progress: a tqdm bar on stderr."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    expected = expected_weights_v4(config)
    for name, shape in tqdm(
        expected.items(), "Building demo weights", len(expected), unit="tensor", disable=not progress
    ):
        if name.endswith(("norm.weight", "_scale")):
            weights[name] = torch.ones(shape)
        elif name.endswith("tid2eid"):
            scores = torch.rand((shape[0], config.n_routed_experts), generator=generator)
            weights[name] = scores.argsort(dim=1)[:, : shape[1]]  # distinct experts per token
        else:
            weights[name] = torch.randn(shape, generator=generator) * 0.02
    return weights


def demo_weights_v41(config: DeepseekV41Config, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic random DeepSeek-V4.1 weights (tests, benchmarks): norms, mixer scales and engram q/k
    weights near 1, sinks, mixer bases and router biases N(0, 0.5), matrices with fan-in-normalised entries."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    shapes = expected_weights_v41(config)
    if config.num_nextn_predict_layers:  # and the DSpark draft layers
        shapes |= dspark_weight_shapes(config)
    for name, shape in shapes.items():
        if name.endswith(("norm.weight", "_scale", "q_weight", "k_weight")):
            tensor = 1 + 0.1 * torch.randn(shape, generator=generator)
        elif name.endswith(("attn_sink", "_base", "gate.bias")):
            tensor = 0.5 * torch.randn(shape, generator=generator)
        else:
            fan_in = shape[-1] if len(shape) > 1 else 1
            tensor = torch.randn(shape, generator=generator) * fan_in**-0.5
        weights[name] = tensor.contiguous()
    return weights


def demo_model(backend: ResolvedBackend, progress: bool = False) -> DeepseekV4Model:
    config = DeepseekV4Config.from_hf(DEMO_CONFIG)
    weights = {
        name: t if FLOAT32_WEIGHTS_V4.search(name) or not t.is_floating_point() else t.to(backend.dtype)
        for name, t in demo_weights(config, progress=progress).items()
    }
    return DeepseekV4Model(config, weights, backend)
