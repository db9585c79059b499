"""DeepSeek-V4 configuration, read from a Hugging Face `config.json` as transformers reads it.

Both spellings are accepted: transformers' (`layer_types`, `compress_rates`, `mlp_layer_types`, nested
`rope_parameters` {main, compress}) and the legacy one of DeepSeek's own files (`compress_ratios` per
layer, `compress_rate_csa` / `_hca`, `num_hash_layers`, `qk_rope_head_dim`, flat `rope_scaling`). Fields
transformers ignores are ignored here too: `num_key_value_heads` (one shared K = V head),
`n_shared_experts` (always one), `norm_topk_prob` (always normalised), MTP layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepinfer_core.backend.ops import RoutingConfig
from deepinfer_core.model.config import ConfigError, RopeConfig

__all__ = ["DeepseekV4Config", "SLIDING", "CSA", "HCA"]

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
_DEFAULT_RATES = {CSA: 4, HCA: 128}
_SCORING = ("sqrtsoftplus", "softmax", "sigmoid")


def _layer_types(raw: dict[str, Any], n: int) -> list[str]:
    if raw.get("layer_types") is not None:
        types = list(raw["layer_types"])
    elif raw.get("compress_ratios") is not None:
        ratios = list(raw["compress_ratios"])
        unknown = sorted({r for r in ratios if r not in _RATIO_TO_TYPE})
        if unknown:
            raise ConfigError(f"compress_ratios holds {unknown}; DeepSeek-V4 layers use 0, 4 or 128")
        types = [_RATIO_TO_TYPE[r] for r in ratios]
    else:  # transformers' default: two HCA layers, then CSA / HCA alternating
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    types = types[:n]
    bad = sorted({t for t in types if t not in (SLIDING, CSA, HCA)})
    if len(types) != n or bad:
        raise ConfigError(
            f"layer_types must name one of {SLIDING}, {CSA}, {HCA} for each of the {n} layers; got {types}"
        )
    return types


def _mlp_layer_types(raw: dict[str, Any], n: int) -> list[str]:
    if raw.get("mlp_layer_types") is not None:
        types = list(raw["mlp_layer_types"])[:n]
    else:
        hashed = int(raw.get("num_hash_layers", 3))
        types = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    if len(types) != n or any(t not in ("hash_moe", "moe") for t in types):
        raise ConfigError(f"mlp_layer_types must be 'hash_moe' or 'moe' for each of the {n} layers; got {types}")
    return types


def _ropes(raw: dict[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    """(main: plain RoPE for sliding layers, compress: the compressed layers' RoPE, YaRN when configured)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        return RopeConfig.from_params(params["main"], raw), RopeConfig.from_params(params["compress"], raw)
    main = RopeConfig(theta=float(raw.get("rope_theta", 10000.0)))
    compress = {k: v for k, v in params.items() if k not in ("main", "compress")}
    compress["rope_theta"] = raw.get("compress_rope_theta", 160000.0)
    if (compress.get("rope_type") or compress.get("type")) == "yarn":
        compress.setdefault("attention_factor", 1.0)  # V4 does not scale cos/sin by YaRN's mscale
    return main, RopeConfig.from_params(compress, raw)


@dataclass(frozen=True, slots=True)
class DeepseekV4Config:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int  # of the one shared K = V head, and of each query head
    q_lora_rank: int
    qk_rope_head_dim: int  # the last dims of each head are rotated
    o_groups: int
    o_lora_rank: int
    layer_types: tuple[str, ...]
    compress_rates: dict[str, int]
    sliding_window: int  # a query sees itself and the sliding_window - 1 tokens before it
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    mlp_layer_types: tuple[str, ...]
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    scoring_func: str
    swiglu_limit: float | None
    rms_norm_eps: float
    max_position_embeddings: int
    rope_main: RopeConfig
    rope_compress: RopeConfig
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...] = field(default=())

    def rate(self, layer: int) -> int:
        """Tokens per compressed entry of `layer` (0 for a sliding-only layer)."""
        kind = self.layer_types[layer]
        return 0 if kind == SLIDING else self.compress_rates[kind]

    def routing(self, layer: int) -> RoutingConfig:
        return RoutingConfig(
            num_experts=self.n_routed_experts,
            top_k=self.num_experts_per_tok,
            method="hash" if self.mlp_layer_types[layer] == "hash_moe" else "greedy",
            scoring=self.scoring_func,
            normalize=True,
            routed_scaling_factor=self.routed_scaling_factor,
        )

    @property
    def replay_tokens(self) -> int:
        """Tokens recomputed before a cached prefix to rebuild the sliding windows and compressor state.

        Layer l's window at position p reads layer l's input at p - window + 1 .. p, which in turn
        depended on layer l - 1's window: exact windows of every layer at the prefix end take the last
        layers x (window - 1) tokens (the CSA overlap reads the previous rate tokens; covered when the
        rate is below the window)."""
        reach = max(self.sliding_window - 1, self.compress_rates[CSA] if CSA in self.layer_types else 0)
        return (self.num_hidden_layers - 1) * (self.sliding_window - 1) + reach

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> DeepseekV4Config:
        def need(name: str):
            if raw.get(name) is None:
                raise ConfigError(f"config.json has no {name!r}, which DeepseekV4ForCausalLM needs")
            return raw[name]

        n = int(need("num_hidden_layers"))
        head_dim = int(raw.get("head_dim", 512))
        if raw.get("partial_rotary_factor") is not None:
            rope_dims = int(head_dim * float(raw["partial_rotary_factor"]))
        else:
            rope_dims = int(raw.get("qk_rope_head_dim", head_dim // 8))
        rates = dict(_DEFAULT_RATES)
        rates.update({k: int(v) for k, v in (raw.get("compress_rates") or {}).items()})
        for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
            if raw.get(legacy) is not None:
                rates[kind] = int(raw[legacy])
        main, compress = _ropes(raw)
        eos = raw.get("eos_token_id")
        limit = raw.get("swiglu_limit", 10.0)
        config = cls(
            architecture="DeepseekV4ForCausalLM",
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            num_hidden_layers=n,
            num_attention_heads=int(need("num_attention_heads")),
            head_dim=head_dim,
            q_lora_rank=int(need("q_lora_rank")),
            qk_rope_head_dim=rope_dims,
            o_groups=int(raw.get("o_groups", 8)),
            o_lora_rank=int(raw.get("o_lora_rank", 1024)),
            layer_types=tuple(_layer_types(raw, n)),
            compress_rates=rates,
            sliding_window=int(raw.get("sliding_window", 128)),
            index_n_heads=int(raw.get("index_n_heads", 64)),
            index_head_dim=int(raw.get("index_head_dim", 128)),
            index_topk=int(raw.get("index_topk", 512)),
            hc_mult=int(raw.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(raw.get("hc_eps", 1e-6)),
            mlp_layer_types=tuple(_mlp_layer_types(raw, n)),
            n_routed_experts=int(need("n_routed_experts")),
            num_experts_per_tok=int(need("num_experts_per_tok")),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)),
            scoring_func=str(raw.get("scoring_func", "sqrtsoftplus")),
            swiglu_limit=None if limit is None else float(limit),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 1048576)),
            rope_main=main,
            rope_compress=compress,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        )
        config._validate()
        return config

    def _validate(self) -> None:
        problems = []
        if self.scoring_func not in _SCORING:
            problems.append(f"scoring_func {self.scoring_func!r} is not one of {', '.join(_SCORING)}")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            problems.append(f"num_attention_heads x head_dim is not divisible by o_groups {self.o_groups}")
        if not 0 < self.qk_rope_head_dim <= min(self.head_dim, self.index_head_dim) or self.qk_rope_head_dim % 2:
            problems.append(f"rope dims {self.qk_rope_head_dim} must be even and fit head_dim and index_head_dim")
        if min(self.compress_rates[CSA], self.compress_rates[HCA], self.sliding_window, self.hc_mult) < 1:
            problems.append("compress rates, sliding_window and hc_mult must be >= 1")
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            problems.append(f"num_experts_per_tok must be in 1..n_routed_experts ({self.n_routed_experts})")
        if problems:
            raise ConfigError(
                "config.json describes a DeepSeek-V4 model DeepInfer cannot build: " + "; ".join(problems)
            )
