"""A tiny random DeepSeek-V4.1 checkpoint (every layer role, two Engram layers) with a tiny word-level tokenizer
written here, for the suite's native-checkpoint cases (no transformers, no test tree).

The tokenizer has VOCAB words; every third is a capitalised copy of the one before ("t4" / "T4"), so the Engram
layers' compressed vocabulary (model/engram_vocab.py: lower-cased, normalised) really merges ids.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = [
    "SCHEDULE",
    "TINY_V41",
    "VOCAB",
    "tiny_v41_config",
    "tiny_v41_weights",
    "with_engram_sizes",
    "write_tokenizer",
]

VOCAB = 512
TINY_V41 = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41_text",
    "vocab_size": VOCAB,
    "hidden_size": 64,  # every expert's K a multiple of 32 (FP4 experts: one scale per 32)
    "num_hidden_layers": 6,
    "compress_ratios": [0, 2, 2, 1, 1, 1],
    "kv_source_layer_ids": [1, 3],
    "index_source_layer_ids": [1, 3, 4],
    "candidate_source_layer_id": 3,
    "engram_layer_ids": [0, 4],
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
    "moe_intermediate_size": 32,
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
    "engram_head_dim": 32,  # a multiple of 32: FP8 tables keep one scale per 32 channels
    "engram_vocab_size": 11,
    "engram_pad_id": 0,
    "eos_token_id": 1,
}


def write_tokenizer(folder: Path) -> Path:
    """tokenizer.json of VOCAB words (a word-level model) into `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"T{i - 1}" if i % 3 == 2 else f"t{i}" for i in range(VOCAB)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


SCHEDULE = (
    "num_hidden_layers",
    "compress_ratios",
    "kv_source_layer_ids",
    "index_source_layer_ids",
    "candidate_source_layer_id",
    "engram_layer_ids",
)  # fmt: skip  (TINY_V41's layer schedule)


def with_engram_sizes(raw: dict, tokenizer_json: Path) -> dict:
    """`raw` with the Engram table sizes its layers imply and the tokenizer's compressed vocabulary size."""
    from deepinfer_core.model.engram_vocab import compressed_vocabulary, engram_primes

    if not raw.get("engram_layer_ids"):
        return dict(raw)
    raw = dict(raw, engram_compressed_vocab_size=compressed_vocabulary(tokenizer_json)[1])
    primes = engram_primes(
        len(raw["engram_layer_ids"]), raw["engram_max_ngram_size"], raw["engram_n_heads"], raw["engram_vocab_size"]
    )
    raw["engram_num_embeddings"] = [sum(map(sum, layer)) for layer in primes]
    return raw


def tiny_v41_config(tokenizer_folder: Path) -> dict:
    """TINY_V41 with the Engram table sizes and the compressed vocabulary of the tokenizer in the folder."""
    return with_engram_sizes(TINY_V41, tokenizer_folder / "tokenizer.json")


def tiny_v41_weights(raw: dict, seed: int = 5) -> dict[str, torch.Tensor]:
    from deepinfer_core.model.config_v41 import DeepseekV41Config
    from deepinfer_core.model.demo import demo_weights_v41

    return demo_weights_v41(DeepseekV41Config.from_hf(raw), seed)
