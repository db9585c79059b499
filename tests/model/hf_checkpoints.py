"""Tiny random Hugging Face DeepSeek-V3 checkpoints for parity tests (issue 3), and the HF model as oracle.

`build_checkpoint(variant, root)` makes a seeded `transformers.DeepseekV3ForCausalLM`, gives it
non-degenerate weights (every parameter re-drawn, router score-correction biases non-zero), saves it
with `save_pretrained` under `root/variant` and returns the path with the float32 eval-mode HF model.
Built once per process and variant: tests/model/conftest.py and tests/engine/test_engine_parity.py load
this file as one module (sys.modules["deepinfer_tests_hf_checkpoints"]), so both share the builds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB = 256
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
VARIANTS = {
    # (a) plain query projection, one expert group, plain RoPE
    "a": dict(
        q_lora_rank=None, n_group=1, topk_group=1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}
    ),
    # (b) low-rank queries, grouped routing (keep 2 of 4 groups), YaRN RoPE with mscale
    "b": dict(q_lora_rank=24, n_group=4, topk_group=2, rope_parameters=YARN),
}
SEEDS = {"a": 1234, "b": 5678}
BIAS_STD = 0.5


@dataclass(frozen=True)
class Checkpoint:
    variant: str
    path: Path
    hf_model: torch.nn.Module  # DeepseekV3ForCausalLM, eval mode, float32


def _redraw_(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Re-draw every parameter so activations stay O(1) through the tiny model and routing and logits
    are far from ties: fan-in-scaled matrices, norms around 1, unit embeddings, a sharper LM head."""
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                value = 1.0 + 0.2 * torch.randn(param.shape, generator=generator)
            elif name.endswith("embed_tokens.weight"):
                value = torch.randn(param.shape, generator=generator)
            elif name.endswith("mlp.gate.weight"):  # router: logits of std ~1 -> sigmoid scores spread out
                value = torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[-1])
            elif name == "lm_head.weight":
                value = 2.0 * torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[-1])
            else:  # linear / expert weights [.., out, in]
                value = torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[-1])
            param.copy_(value)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # HF's init leaves it at zero
                buffer.copy_(BIAS_STD * torch.randn(buffer.shape, generator=generator))


def _build(variant: str, root: Path) -> Checkpoint:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(SEEDS[variant])
    config = DeepseekV3Config(**BASE, **VARIANTS[variant], num_mtp_layers=0)
    model = DeepseekV3ForCausalLM(config).to(torch.float32).eval()
    _redraw_(model, torch.Generator().manual_seed(SEEDS[variant]))
    model.generation_config.eos_token_id = None  # the oracle never stops early
    model.generation_config.pad_token_id = 0
    path = root / f"deepseek-v3-tiny-{variant}"
    model.save_pretrained(path)
    biases = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    assert len(biases) == config.num_hidden_layers - config.first_k_dense_replace
    assert all(b.abs().min() > 0 for b in biases)
    return Checkpoint(variant, path, model)


_built: dict[str, Checkpoint] = {}


def build_checkpoint(variant: str, root: Path) -> Checkpoint:
    """The checkpoint of `variant` ("a" or "b"), built on first use under `root` (later roots are ignored)."""
    if variant not in _built:
        _built[variant] = _build(variant, Path(root))
    return _built[variant]
