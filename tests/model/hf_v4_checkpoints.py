"""Tiny random Hugging Face DeepSeek-V4 checkpoints for the parity tests (issue 8), and the HF model as oracle.

`build_v4_checkpoint(variant, root)` makes a seeded `transformers.DeepseekV4ForCausalLM`, fills the
parameters transformers initialises to zero (attention sinks, compressor position biases, hyper-
connection biases, the hash-routing table, router biases) with random values so that every path is
exercised, saves it with `save_pretrained` under `root/variant` and returns it with the float32 HF model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB = 256
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    moe_intermediate_size=32,
    num_attention_heads=4,
    head_dim=32,
    q_lora_rank=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    o_lora_rank=16,
    index_n_heads=2,
    index_head_dim=16,
    max_position_embeddings=4096,
    initializer_range=0.1,  # logits of std ~0.8: far outside the float32 tolerance when anything differs
    bos_token_id=0,
    eos_token_id=1,
)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32, "beta_slow": 1}
VARIANTS = {
    # (a) the three attention types, YaRN on the compressed ones, hash routing first; indexer top-k above
    # the entry count (exact parity: with a small k, ReLU's exact-zero scores tie and torch.topk breaks
    # ties its own way)
    "a": dict(
        num_hidden_layers=4,
        layer_types=[SLIDING, CSA, HCA, CSA],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={CSA: 4, HCA: 8},
        sliding_window=8,
        o_groups=2,
        index_topk=64,
        hc_mult=2,
        hc_sinkhorn_iters=5,
        rope_parameters=YARN,
    ),
    # (b) other rates and window, three streams, plain RoPE, two hash layers, a small indexer top-k
    "b": dict(
        num_hidden_layers=3,
        layer_types=[HCA, CSA, SLIDING],
        mlp_layer_types=["hash_moe", "hash_moe", "moe"],
        compress_rates={CSA: 2, HCA: 16},
        sliding_window=5,
        o_groups=4,
        index_topk=64,
        hc_mult=3,
        hc_sinkhorn_iters=3,
        swiglu_limit=0.5,  # low enough that the clamp acts on these activations
    ),
    # (sliding) every layer sliding-window only: no paged cache at all, only the per-sequence windows
    "sliding": dict(
        num_hidden_layers=2,
        layer_types=[SLIDING, SLIDING],
        mlp_layer_types=["hash_moe", "moe"],
        sliding_window=6,
        o_groups=2,
        index_topk=64,
        hc_mult=2,
        hc_sinkhorn_iters=3,
    ),
}
SEEDS = {"a": 4321, "b": 8765, "sliding": 2468}


@dataclass(frozen=True)
class Checkpoint:
    variant: str
    path: Path
    hf_model: torch.nn.Module  # DeepseekV4ForCausalLM, eval mode, float32


def _fill_zero_initialised_(model: torch.nn.Module, generator: torch.Generator, experts: int, top_k: int) -> None:
    def normal(shape, std):
        return std * torch.randn(shape, generator=generator)

    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith(("position_bias", "sinks")):
                param.copy_(normal(param.shape, 0.5))
            elif name.endswith(("_hc.base", "hc_head.hc_base")):
                param.copy_(normal(param.shape, 0.5))
        for name, buffer in sorted(model.named_buffers()):
            if name.endswith("tid2eid"):
                rows = [torch.randperm(experts, generator=generator)[:top_k] for _ in range(buffer.shape[0])]
                buffer.copy_(torch.stack(rows))
            elif name.endswith("e_score_correction_bias"):
                buffer.copy_(normal(buffer.shape, 0.05))


def _build(variant: str, root: Path) -> Checkpoint:
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(SEEDS[variant])
    config = DeepseekV4Config(**BASE, **VARIANTS[variant])
    model = DeepseekV4ForCausalLM(config).to(torch.float32).eval()
    _fill_zero_initialised_(
        model, torch.Generator().manual_seed(SEEDS[variant]), config.n_routed_experts, config.num_experts_per_tok
    )
    model.generation_config.eos_token_id = None  # the oracle never stops early
    model.generation_config.pad_token_id = 0
    path = root / f"deepseek-v4-tiny-{variant}"
    model.save_pretrained(path)
    return Checkpoint(variant, path, model)


_built: dict[str, Checkpoint] = {}


def build_v4_checkpoint(variant: str, root: Path) -> Checkpoint:
    """The checkpoint of `variant` (a key of VARIANTS), built on first use under `root` (later roots are ignored)."""
    if variant not in _built:
        _built[variant] = _build(variant, Path(root))
    return _built[variant]
