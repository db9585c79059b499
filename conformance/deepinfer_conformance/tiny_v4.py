"""A tiny random DeepSeek-V4 checkpoint written with safetensors, for the suite's end-to-end V4 case and for
backend tests that run the same model (neither needs transformers).

Weights are scaled so activations stay O(1) and the logits are clearly peaked; the parameters transformers
initialises to zero (mixer biases, sinks, position biases, router biases) are non-zero so every path counts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

__all__ = ["TINY_V4", "tiny_v4_weights", "write_tiny_v4"]

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
TINY_V4 = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "layer_types": [SLIDING, CSA, HCA, CSA],  # every attention kind
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],  # hash routing, then sqrtsoftplus top-k
    "compress_rates": {CSA: 4, HCA: 16},
    "sliding_window": 8,
    "num_attention_heads": 4,
    "head_dim": 32,
    "partial_rotary_factor": 0.125,  # 4 rope dims
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 8,  # below the entry count of the longer prompts: the indexer really chooses
    "hc_mult": 2,
    "hc_sinkhorn_iters": 5,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "swiglu_limit": 1.0,  # low enough that the clamp acts on these activations (V4's default 10 would not)
    "max_position_embeddings": 1024,
    "eos_token_id": 1,
}


def _tensor_v4(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    noise = torch.randn(shape, generator=generator)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * noise
    if name.endswith("_scale"):  # the hyper-connection mixers' scales
        return 1.0 + 0.1 * noise
    if name.endswith(("_base", "attn_sink", ".ape", "gate.bias")):
        return 0.5 * noise  # non-zero, as transformers would leave them zero: every path counts
    if name == "model.embed_tokens.weight":
        return noise
    if name == "head.weight":
        return noise * (4.0 / math.sqrt(shape[1]))  # logits std ~4 over a normalised hidden state
    return noise * (1.0 / math.sqrt(shape[1]))  # [out, in] projections (hc fn too): unit gain


def tiny_v4_weights(config: dict = TINY_V4, seed: int = 4321) -> dict[str, torch.Tensor]:
    """The random weights of a tiny V4 (`config`), under our names, float32 (hash tables int64)."""
    from deepinfer_core.model.config_v4 import DeepseekV4Config
    from deepinfer_core.model.deepseek_v4 import expected_weights_v4

    cfg = DeepseekV4Config.from_hf(config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in expected_weights_v4(cfg).items():
        if name.endswith("gate.tid2eid"):  # token id -> experts: int64, distinct experts per row
            rows = [torch.randperm(cfg.n_routed_experts, generator=generator)[: shape[1]] for _ in range(shape[0])]
            tensors[name] = torch.stack(rows).to(torch.int64)
        else:
            tensors[name] = _tensor_v4(name, shape, generator).contiguous()
    return tensors


def write_tiny_v4(path: Path, config: dict = TINY_V4, seed: int = 4321) -> Path:
    """Write config.json and model.safetensors of a tiny V4 (`config`) into the folder `path`."""
    from safetensors.torch import save_file

    save_file(tiny_v4_weights(config, seed), str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path
