"""DeepSeek V2/V3 model configuration, read from a Hugging Face `config.json` in either spelling.

DeepSeek's own configs carry `rope_scaling` and `topk_method` / `scoring_func`; transformers' saved
configs carry `rope_parameters` and omit the routing fields (its V3 always routes noaux_tc + sigmoid).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepinfer_core.backend.ops import RoutingConfig
from deepinfer_core.errors import DeepInferError

__all__ = ["DeepseekConfig", "RopeConfig", "ConfigError"]

SUPPORTED_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")


class ConfigError(DeepInferError, ValueError):
    """config.json is missing a field or holds a value DeepInfer cannot serve."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # "default" or "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # YaRN: the cos/sin factor when given (V4 sets 1), else from mscale

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> RopeConfig:
        return cls.from_params(raw.get("rope_parameters") or raw.get("rope_scaling") or {}, raw)

    @classmethod
    def from_params(cls, params: dict[str, Any], raw: dict[str, Any]) -> RopeConfig:
        """From one rope-parameters dict; `raw` (the whole config) supplies a top-level rope_theta."""
        kind = params.get("rope_type") or params.get("type") or "default"
        if kind not in ("default", "yarn"):
            raise ConfigError(f"rope scaling type {kind!r} is not supported (supported: default, yarn)")
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        if kind == "default":
            return cls(theta=float(theta))
        return cls(
            theta=float(theta),
            kind=kind,
            factor=float(params.get("factor") or 1.0),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings") or 4096),
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            mscale=float(params.get("mscale") or 0),
            mscale_all_dim=float(params.get("mscale_all_dim") or 0),
            attention_factor=None if params.get("attention_factor") is None else float(params["attention_factor"]),
        )


def _routing(**fields) -> RoutingConfig:
    try:
        return RoutingConfig(**fields)
    except ValueError as err:
        raise ConfigError(f"config.json's MoE routing fields are inconsistent: {err}") from None


@dataclass(frozen=True, slots=True)
class DeepseekConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    rope_interleave: bool
    attention_bias: bool
    first_k_dense_replace: int
    moe_layer_freq: int
    moe_intermediate_size: int
    n_routed_experts: int  # 0: a dense model
    n_shared_experts: int
    routing: RoutingConfig | None
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...] = field(default=())

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached MLA entry: the compressed KV plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, index: int) -> bool:
        return self.n_routed_experts > 0 and index >= self.first_k_dense_replace and index % self.moe_layer_freq == 0

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> DeepseekConfig:
        architectures = raw.get("architectures") or []
        architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if architecture is None:
            found = ", ".join(architectures) or "none"
            raise ConfigError(
                f"unknown architecture {found} in config.json; DeepInfer serves {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def need(name: str):
            if raw.get(name) is None:
                raise ConfigError(f"config.json has no {name!r}, which {architecture} needs")
            return raw[name]

        v3 = architecture == "DeepseekV3ForCausalLM"
        experts = int(raw.get("n_routed_experts") or 0)
        routing = None
        if experts:
            routing = _routing(
                num_experts=experts,
                top_k=int(need("num_experts_per_tok")),
                method=raw.get("topk_method") or ("noaux_tc" if v3 else "greedy"),
                scoring=raw.get("scoring_func") or ("sigmoid" if v3 else "softmax"),
                num_groups=int(raw.get("n_group") or 1),
                topk_groups=int(raw.get("topk_group") or 1),
                normalize=bool(raw.get("norm_topk_prob", v3)),
                routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
            )
        eos = raw.get("eos_token_id")
        q_lora = raw.get("q_lora_rank")
        return cls(
            architecture=architecture,
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=int(need("num_attention_heads")),
            kv_lora_rank=int(need("kv_lora_rank")),
            q_lora_rank=int(q_lora) if q_lora else None,
            qk_nope_head_dim=int(need("qk_nope_head_dim")),
            qk_rope_head_dim=int(need("qk_rope_head_dim")),
            v_head_dim=int(need("v_head_dim")),
            max_position_embeddings=int(need("max_position_embeddings")),
            rms_norm_eps=float(raw.get("rms_norm_eps") or 1e-6),
            rope=RopeConfig.from_hf(raw),
            rope_interleave=bool(raw.get("rope_interleave", True)),
            attention_bias=bool(raw.get("attention_bias", False)),
            first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(raw.get("moe_layer_freq") or 1),
            moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
            n_routed_experts=experts,
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            routing=routing,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        )
