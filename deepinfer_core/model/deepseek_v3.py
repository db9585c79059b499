"""The DeepSeek-V3 (and V2-style) decoder: embeddings, MLA + MLP/MoE blocks, final norm, LM head.

Single-device model code over the backend contract; expert parallelism enters through the backend's
communicator inside `MoE`. Weight names are those of Hugging Face checkpoints.
"""

from __future__ import annotations

import re

import torch

from deepinfer_core.backend.ops import AttentionMetadata
from deepinfer_core.backend.resolve import ResolvedBackend
from deepinfer_core.kv.layout import CacheKind, CacheSpec
from deepinfer_core.model.config import DeepseekConfig
from deepinfer_core.model.layers import DenseMLP, MLAttention, MoE
from deepinfer_core.model.rope import rotary_tables, softmax_scale

__all__ = ["DeepseekV3Model", "expected_weights", "FLOAT32_WEIGHTS", "FP8_WEIGHTS", "QUANTIZED_WEIGHTS"]

# Router weights and biases stay float32 whatever the compute dtype, as in DeepSeek's checkpoints.
FLOAT32_WEIGHTS = re.compile(r"\.mlp\.gate\.(weight|e_score_correction_bias)$")
# Weights only `linear` / `expert_ffn` read: kept FP8 for backends that take ops.BlockFP8 (kv_b_proj is
# split into the absorbed per-head matrices at load, so it is always dequantized).
FP8_WEIGHTS = re.compile(r"\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|o_proj|gate_proj|up_proj|down_proj)\.weight$")
QUANTIZED_WEIGHTS = {"fp8_block": FP8_WEIGHTS}  # format -> the weights kept in it (loader.load_tensors)


def _attention_shapes(cfg: DeepseekConfig, p: str) -> dict[str, tuple[int, ...]]:
    d, heads = cfg.hidden_size, cfg.num_attention_heads
    shapes = {
        f"{p}.kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, d),
        f"{p}.kv_a_layernorm.weight": (cfg.kv_lora_rank,),
        f"{p}.kv_b_proj.weight": (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        f"{p}.o_proj.weight": (d, heads * cfg.v_head_dim),
    }
    if cfg.q_lora_rank is None:
        shapes[f"{p}.q_proj.weight"] = (heads * cfg.qk_head_dim, d)
    else:
        shapes[f"{p}.q_a_proj.weight"] = (cfg.q_lora_rank, d)
        shapes[f"{p}.q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        shapes[f"{p}.q_b_proj.weight"] = (heads * cfg.qk_head_dim, cfg.q_lora_rank)
    if cfg.attention_bias:
        shapes[f"{p}.q_a_proj.bias" if cfg.q_lora_rank else f"{p}.q_proj.bias"] = (
            (cfg.q_lora_rank,) if cfg.q_lora_rank else (heads * cfg.qk_head_dim,)
        )
        shapes[f"{p}.kv_a_proj_with_mqa.bias"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim,)
        shapes[f"{p}.o_proj.bias"] = (d,)
    return shapes


def _mlp_shapes(p: str, d: int, inner: int) -> dict[str, tuple[int, ...]]:
    return {f"{p}.gate_proj.weight": (inner, d), f"{p}.up_proj.weight": (inner, d), f"{p}.down_proj.weight": (d, inner)}


def expected_weights(cfg: DeepseekConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model reads, with the shape the config implies."""
    d = cfg.hidden_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (d,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (d,)
        shapes.update(_attention_shapes(cfg, f"{p}.self_attn"))
        if not cfg.is_moe_layer(i):
            shapes.update(_mlp_shapes(f"{p}.mlp", d, cfg.intermediate_size))
            continue
        shapes[f"{p}.mlp.gate.weight"] = (cfg.n_routed_experts, d)
        if cfg.routing.method == "noaux_tc":
            shapes[f"{p}.mlp.gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
        for e in range(cfg.n_routed_experts):
            shapes.update(_mlp_shapes(f"{p}.mlp.experts.{e}", d, cfg.moe_intermediate_size))
        if cfg.n_shared_experts:
            shapes.update(_mlp_shapes(f"{p}.mlp.shared_experts", d, cfg.moe_intermediate_size * cfg.n_shared_experts))
    return shapes


class DeepseekV3Model:
    """Holds the weights on the backend's device and runs one step over a ragged batch."""

    graph_capture = True  # its decode steps can be replayed from device graphs
    replay_tokens = 0  # no per-sequence caches to rebuild on a prefix hit

    def __init__(self, config: DeepseekConfig, weights: dict[str, torch.Tensor], backend: ResolvedBackend) -> None:
        device = backend.torch_device
        w = {name: t.to(device) for name, t in weights.items()}
        self.config, self.backend, self.ops = config, backend, backend.ops
        self.cache_spec = CacheSpec(
            CacheKind.PAGED,
            backend.dtype,
            num_heads=1,
            head_dim=config.latent_dim,
            parts=(config.kv_lora_rank, config.qk_rope_head_dim),  # latent | rotated shared key
        )
        self.cache_specs = [{"kv": self.cache_spec}] * config.num_hidden_layers
        cos, sin = rotary_tables(config.rope, config.qk_rope_head_dim, config.max_position_embeddings)
        rope = (cos.to(device), sin.to(device))
        scale = softmax_scale(config.rope, config.qk_head_dim)
        self.embed = w["model.embed_tokens.weight"]  # [V, D]
        self.norm = w["model.norm.weight"]
        self.lm_head = self.embed if config.tie_word_embeddings else w["lm_head.weight"]
        self.layers = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}"
            attention = MLAttention(backend, config, w, f"{p}.self_attn", rope, scale)
            if config.is_moe_layer(i):
                mlp = MoE.from_weights(backend, config, w, f"{p}.mlp")
            else:
                mlp = DenseMLP.from_weights(backend, w, f"{p}.mlp")
            self.layers.append(
                (w[f"{p}.input_layernorm.weight"], attention, w[f"{p}.post_attention_layernorm.weight"], mlp)
            )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        caches: list[dict[str, torch.Tensor]],
    ) -> torch.Tensor:
        """token_ids, positions [T] -> final hidden states [T, D]; writes this step's latents to `caches`
        (per layer, the cache named "kv" of `cache_specs`)."""
        ops, eps = self.ops, self.config.rms_norm_eps
        hidden = self.embed[token_ids]  # [T, D]
        for (attn_norm, attention, mlp_norm, mlp), cache in zip(self.layers, caches):
            hidden = hidden + attention(
                ops.rms_norm(hidden, attn_norm, eps), positions, meta, cache["kv"], self.cache_spec
            )
            hidden = hidden + mlp(ops.rms_norm(hidden, mlp_norm, eps))
        return ops.rms_norm(hidden, self.norm, eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> logits [N, V] float32."""
        return self.ops.linear(hidden, self.lm_head).float()
