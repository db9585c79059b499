"""What offline_throughput.py runs on: a seeded random DeepSeek-V3 checkpoint and seeded random prompts."""

from __future__ import annotations

from pathlib import Path

import torch

DEFAULT_CONFIG = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "qk_rope_head_dim": 32,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}

CHECKPOINT_ORIGIN = "random, transformers DeepseekV3ForCausalLM(config) seeded, e_score_correction_bias ~ N(0, 0.05)"


def make_checkpoint(path: Path, config_overrides: dict, seed: int) -> dict:
    """Random DeepseekV3ForCausalLM (seeded) saved to `path`; e_score_correction_bias set non-zero."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(**{**DEFAULT_CONFIG, **config_overrides})
    model = DeepseekV3ForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buffer in list(model.named_buffers()) + list(model.named_parameters()):
            if name.endswith("e_score_correction_bias"):
                # transformers leaves it at zero; non-zero changes routing, so the benchmark covers it
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.05)
    model.save_pretrained(path)
    return {**DEFAULT_CONFIG, **config_overrides}


def make_prompts(count: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    """Random token ids, avoiding the first 8 ids (BOS/EOS/pad in most configs)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=generator).tolist()
    return [torch.randint(8, vocab, (n,), generator=generator).tolist() for n in lengths]


def describe_workload(
    num_prompts: int, min_len: int, max_len: int, max_new_tokens: int, prompt_sets: list, seed: int
) -> dict:
    """The report's "workload" entry; `prompt_sets` holds one set of `num_prompts` prompts per repeat."""
    repeats = len(prompt_sets)
    return {
        "num_prompts": num_prompts,
        "prompt_len_range": [min_len, max_len],
        "mean_prompt_len": sum(len(p) for ps in prompt_sets for p in ps) / (num_prompts * repeats),
        "max_new_tokens": max_new_tokens,
        "greedy": True,
        "ignore_eos": True,
        "prompt_tokens": "uniform random ids in [8, vocab); a fresh set per repeat, the same set for every system",
        "repeats": repeats,
        "order": "systems interleaved within each repeat",
        "seed": seed,
        "warmup": "one generate per system on 4 other random prompts, 4 new tokens, before timing",
    }
