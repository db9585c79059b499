"""A tiny random DeepSeek-V3 checkpoint written with safetensors: a model any backend with the core ops can
run (no DeepSeek-V4 ops), for trying a new backend end to end and for tests (neither needs transformers).

    python -m deepinfer_conformance.tiny_v3 ./tiny-v3
    deepinfer generate --model ./tiny-v3 --prompt-token-ids 3,14,15,92 --temperature 0

Weights are scaled so activations stay O(1) and the logits are clearly peaked. There is no tokenizer:
prompts are token ids (vocabulary 512).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

__all__ = ["TINY_V3", "write_tiny_v3"]

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


def write_tiny_v3(path: Path, q_lora_rank: int | None = None, config: dict = TINY_V3, seed: int = 1234) -> Path:
    """Write config.json and model.safetensors of a tiny V3 (`config`, with `q_lora_rank`) into the folder
    `path` (created if missing); returns `path`."""
    from safetensors.torch import save_file

    from deepinfer_core.model.config import DeepseekConfig
    from deepinfer_core.model.deepseek_v3 import expected_weights

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    raw = dict(config, q_lora_rank=q_lora_rank)
    generator = torch.Generator().manual_seed(seed)
    shapes = expected_weights(DeepseekConfig.from_hf(raw))
    save_file({n: _tensor(n, s, generator).contiguous() for n, s in shapes.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(raw))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deepinfer_conformance.tiny_v3", description="write a tiny random DeepSeek-V3 checkpoint"
    )
    parser.add_argument("folder", type=Path, help="where to write config.json and model.safetensors")
    parser.add_argument("--q-lora-rank", type=int, default=None, help="low-rank query projection (default: none)")
    args = parser.parse_args(argv)
    path = write_tiny_v3(args.folder, args.q_lora_rank)
    print(f"wrote a tiny DeepSeek-V3 checkpoint (random weights, vocabulary {TINY_V3['vocab_size']}) to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
