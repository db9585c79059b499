"""Tiny DeepSeek-V4.1 checkpoints with random weights, written in the reference's layout (config.json, one
safetensors file, the fixtures' tokenizer for the engram hashes), for tests that vary the schedule freely.

With head_dim and index_head_dim not multiples of 16 the FP8/FP4 rounding of the caches does not apply (the
reference skips it then too), so two runs that add up floats in a different order cannot land on opposite
sides of a rounding step: engine tests can then ask for identical outputs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import save_file

from deepinfer_core.model.config_v41 import DeepseekV41Config
from deepinfer_core.model.demo import demo_weights_v41
from deepinfer_core.model.engram_vocab import compressed_vocabulary, engram_primes

TOKENIZER_FROM = Path(__file__).parents[1] / "fixtures" / "deepseek_v41" / "engram_top1"
VOCAB = 338  # the fixtures' tokenizer

BASE = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41_text",
    "vocab_size": VOCAB,
    "hidden_size": 40,
    "num_attention_heads": 2,
    "head_dim": 24,
    "q_lora_rank": 20,
    "qk_rope_head_dim": 8,
    "o_groups": 2,
    "o_lora_rank": 12,
    "index_n_heads": 4,
    "index_head_dim": 12,
    "index_topk": 3,
    "candidate_block_size": 2,
    "candidate_topk_blocks": 2,
    "moe_intermediate_size": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "gate_temp": 0.8,
    "swiglu_limit": 1.0,
    "hc_mult": 3,
    "hc_sinkhorn_iters": 3,
    "sliding_window": 6,
    "max_position_embeddings": 512,
    "compress_rope_theta": 40000.0,
    "num_nextn_predict_layers": 0,
    "engram_max_ngram_size": 3,
    "engram_n_heads": 2,
    "engram_head_dim": 16,
    "engram_vocab_size": 11,
    "engram_pad_id": 0,
    "eos_token_id": 1,
}

# schedules that together cover every layer role (see docs/deepseek_v41_reference.md §8)
SCHEDULES = {
    "groups_and_candidates": {
        "num_hidden_layers": 6,
        "compress_ratios": [0, 2, 2, 1, 1, 1],
        "kv_source_layer_ids": [1, 3],
        "index_source_layer_ids": [1, 3, 4],
        "candidate_source_layer_id": 3,
        "engram_layer_ids": [0, 4],
    },
    "ratio_four_then_decoder": {
        "num_hidden_layers": 5,
        "compress_ratios": [0, 4, 4, 1, 1],
        "kv_source_layer_ids": [1, 3],
        "index_source_layer_ids": [1, 3],
        "candidate_source_layer_id": -1,
        "engram_layer_ids": [2],
        "hc_mult": 2,
        "sliding_window": 5,
        "num_experts_per_tok": 1,
    },
}


def checkpoint_config(overrides: dict) -> dict:
    """The config.json of BASE | overrides, with the engram table sizes its layers imply."""
    raw = {**BASE, **overrides}
    if raw.get("engram_layer_ids"):
        raw["engram_compressed_vocab_size"] = compressed_vocabulary(TOKENIZER_FROM / "tokenizer.json")[1]
        primes = engram_primes(
            len(raw["engram_layer_ids"]), raw["engram_max_ngram_size"], raw["engram_n_heads"], raw["engram_vocab_size"]
        )
        raw["engram_num_embeddings"] = [sum(map(sum, layer)) for layer in primes]
    return raw


def copy_tokenizer(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOKENIZER_FROM / name, folder / name)
    return folder


def write_checkpoint(folder: Path, overrides: dict, seed: int = 0) -> Path:
    """A checkpoint in `folder` for BASE | overrides, random weights from `seed`."""
    raw = checkpoint_config(overrides)
    weights = demo_weights_v41(DeepseekV41Config.from_hf(raw), seed)
    copy_tokenizer(folder)
    save_file(weights, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(raw, indent=1))
    return folder
