"""The random-weights DeepSeek-V4 and V4.1 checkpoints prefix_replay.py measures: configs and writers."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from deepinfer_core.model.config_v4 import CSA, HCA, SLIDING, DeepseekV4Config
from deepinfer_core.model.config_v41 import DeepseekV41Config
from deepinfer_core.model.demo import demo_weights, demo_weights_v41

V4 = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "vocab_size": 4096,
    "hidden_size": 256,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 8,
    "layer_types": [SLIDING, CSA, HCA, CSA, SLIDING, CSA, HCA, CSA],
    "mlp_layer_types": ["hash_moe"] * 3 + ["moe"] * 5,
    "compress_rates": {CSA: 4, HCA: 128},
    "sliding_window": 128,
    "num_attention_heads": 4,
    "head_dim": 128,
    "partial_rotary_factor": 0.125,
    "q_lora_rank": 128,
    "o_groups": 2,
    "o_lora_rank": 64,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 512,
    "hc_mult": 4,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "max_position_embeddings": 65536,
    "eos_token_id": 1,
}
# V4.1 at tiny widths with the released attention shape: 128-token window, the default schedule for the
# layer count (two sliding layers, ratio-2 encoder layers, ratio-1 decoder layers), 4 hyper-connection
# streams; no engram layers (their look-back of max_ngram_size - 1 tokens is within one window)
V41 = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41_text",
    "vocab_size": 4096,
    "hidden_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "head_dim": 64,
    "q_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "o_groups": 2,
    "o_lora_rank": 32,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 128,
    "candidate_block_size": 8,
    "candidate_topk_blocks": 32,
    "moe_intermediate_size": 64,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "hc_mult": 4,
    "sliding_window": 128,
    "max_position_embeddings": 65536,
    "num_nextn_predict_layers": 0,
    "eos_token_id": 1,
}
MODELS = {"v4": V4, "v41": V41, "v41-40layers": {**V41, "num_hidden_layers": 40}}  # 40: V4.1 Flash's depth
FLASH_LAYERS = {"DeepseekV4ForCausalLM": 43, "DeepseekV41ForCausalLM": 40}  # V4 Flash, V4.1 Flash


def is_v41(raw: dict) -> bool:
    return raw["architectures"] == ["DeepseekV41ForCausalLM"]


def make_checkpoint(raw: dict, folder: Path) -> Path:
    """config.json and model.safetensors of `raw` with random weights (seed 7) in `folder`."""
    if is_v41(raw):
        weights = demo_weights_v41(DeepseekV41Config.from_hf(raw), seed=7)
    else:
        weights = demo_weights(DeepseekV4Config.from_hf(raw), seed=7)
    save_file({name: t.contiguous() for name, t in weights.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def block_size(raw: dict) -> int:
    """DeepSeek's 128-token blocks where a compression rate needs them (or V4.1), else 64."""
    if is_v41(raw):
        return 128
    return 128 if max(DeepseekV4Config.from_hf(raw).compress_rates.values()) > 64 else 64
