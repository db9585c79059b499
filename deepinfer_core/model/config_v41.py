"""DeepSeek-V4.1 text configuration, read from a checkpoint's `config.json` as transformers reads it.

Two shapes are accepted: the composite `DeepseekV41ForCausalLM` config (model_type "deepseek_v41", text
fields under `text_config`, `quantization_config` and `vision_config` at the top; the vision tower is
ignored) and a flat text config (model_type "deepseek_v41_text", or the text fields at the top level).
Defaults and derivations are those of transformers' DeepseekV41TextConfig (docs/deepseek_v41_reference.md
§1); besides its checks, the schedules it runs oddly (v41_schedule) and engram tables that do not fit
their prime buckets are refused. Keys DeepInfer does not read are ignored, as for V4, and listed in
`ignored_fields`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepinfer_core.backend.ops import RoutingConfig
from deepinfer_core.model import engram_vocab
from deepinfer_core.model.config import ConfigError, RopeConfig
from deepinfer_core.model.v41_schedule import LayerPlan, derive_schedule, layer_plans

__all__ = ["DeepseekV41Config", "LayerPlan"]

_SCORING = ("sqrtsoftplus", "softmax", "sigmoid")

# Every scalar field of DeepseekV41TextConfig with its default, in the reference's order.
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 64,
    "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1280, "qk_rope_head_dim": 64,
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "max_position_embeddings": 1048576,
    "attention_bias": False, "attention_dropout": 0.0, "sliding_window": 128,
    "candidate_topk_blocks": 2048, "candidate_block_size": 8,
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "o_groups": 8, "o_lora_rank": 1024,
    "moe_intermediate_size": 2304, "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 6,
    "scoring_func": "sqrtsoftplus", "gate_temp": 1.0, "norm_topk_prob": True, "routed_scaling_factor": 1.5,
    "topk_method": "noaux_tc", "swiglu_limit": 10.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "engram_vocab_size": 16_000_000, "engram_max_ngram_size": 4, "engram_n_heads": 8, "engram_head_dim": 256,
    "engram_pad_id": 2, "engram_compressed_vocab_size": 99092,
    "num_nextn_predict_layers": 3, "dspark_block_size": 5, "dspark_noise_token_id": 128799,
    "dspark_markov_rank": 256, "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3,
    "hidden_act": "silu", "initializer_range": 0.02, "rms_norm_eps": 1e-20, "use_cache": True,
    "tie_word_embeddings": False, "pad_token_id": None, "bos_token_id": None, "eos_token_id": 1,
    "output_router_logits": False, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
}  # fmt: skip
_DERIVED = (
    "compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id",
    "dspark_target_layer_ids", "engram_layer_ids", "engram_num_embeddings", "rope_parameters", "rope_scaling",
    "layer_types", "expert_dtype",
)  # fmt: skip
_INT_FIELDS = (
    "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "q_lora_rank",
    "max_position_embeddings", "sliding_window", "candidate_topk_blocks", "candidate_block_size",
    "index_n_heads", "index_head_dim", "index_topk", "o_groups", "o_lora_rank", "moe_intermediate_size",
    "n_routed_experts", "num_experts_per_tok", "hc_mult", "hc_sinkhorn_iters", "engram_vocab_size",
    "engram_n_heads", "engram_head_dim", "engram_max_ngram_size", "engram_pad_id", "engram_compressed_vocab_size",
    "dspark_block_size", "dspark_noise_token_id", "dspark_markov_rank", "dspark_n_routed_experts",
    "dspark_num_experts_per_tok",
)  # fmt: skip
_FLOAT_FIELDS = (
    "rope_theta", "compress_rope_theta", "attention_dropout", "gate_temp", "routed_scaling_factor", "swiglu_limit",
    "hc_eps", "initializer_range", "rms_norm_eps", "router_aux_loss_coef", "router_jitter_noise",
)  # fmt: skip
_BOOL_FIELDS = ("attention_bias", "norm_topk_prob", "use_cache", "tie_word_embeddings", "output_router_logits")
_NON_NEGATIVE = ("engram_pad_id", "dspark_noise_token_id", "num_experts_per_tok", "dspark_num_experts_per_tok")
_ALIASES = {"num_local_experts": "n_routed_experts", "intermediate_size": "moe_intermediate_size"}
_HF_KEYS = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
    "name_or_path", "auto_map", "quantization_config", "return_dict", "output_hidden_states",
    "output_attentions", "id2label", "label2id", "problem_type", "is_encoder_decoder", "tokenizer_class",
}  # fmt: skip
_TEXT_KEYS = set(_DEFAULTS) | set(_DERIVED) | set(_ALIASES) | {"engram_pad_token_id"} | _HF_KEYS
_COMPOSITE_KEYS = {"text_config", "vision_config", "image_token_id", "tie_word_embeddings"} | _HF_KEYS


def _text_section(raw: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """(the text fields, quantization_config hoisted into them; the keys DeepInfer ignores)."""
    kind = raw.get("model_type")
    if kind not in (None, "deepseek_v41", "deepseek_v41_text"):
        raise ConfigError(f"config.json's model_type {kind!r} is not DeepSeek-V4.1 (deepseek_v41 or deepseek_v41_text)")
    nested = raw.get("text_config")
    if kind == "deepseek_v41_text" or (nested is None and _TEXT_KEYS.intersection(set(raw) - _HF_KEYS)):
        text = dict(raw)
        ignored = sorted(set(raw) - _TEXT_KEYS - _COMPOSITE_KEYS)
    elif nested is None or isinstance(nested, dict):  # composite; no text fields at all: the released sizes
        text = dict(nested or {})
        if text.get("model_type") not in (None, "deepseek_v41_text"):
            raise ConfigError(f"text_config's model_type {text['model_type']!r} is not deepseek_v41_text")
        if raw.get("quantization_config") is not None:
            text["quantization_config"] = raw["quantization_config"]
        text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))  # a field of both levels
        ignored = sorted(set(raw) - _COMPOSITE_KEYS) + [f"text_config.{k}" for k in sorted(set(text) - _TEXT_KEYS)]
    else:
        raise ConfigError(f"config.json's text_config must be an object of text-model fields; got {nested!r}")
    for alias, name in _ALIASES.items():
        if alias in text and name in text and text[alias] != text[name]:
            raise ConfigError(f"config.json gives both {name} and {alias} (its alias) with different values; keep one")
        if alias in text:
            text[name] = text[alias]
    return text, tuple(ignored)


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise ConfigError(f"config.json's {name} must be an integer; it is {value!r}")
    return int(value)


def _ints(name: str, value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"config.json's {name} must be a list of integers; it is {value!r}")
    return tuple(_int(name, v) for v in value)


def _ropes(
    text: dict[str, Any], head_dim: int, rope_dims: int, theta: float, compress_theta: float
) -> tuple[RopeConfig, RopeConfig]:
    """(main: plain RoPE for ratio-0 layers, compress: every other layer's, with YaRN when configured)."""
    params = text.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        ropes = {label: params[label] for label in ("main", "compress")}  # as saved by transformers: kept as is
    else:
        partial = rope_dims / head_dim
        yarn = {k: v for k, v in (text.get("rope_scaling") or params).items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": partial}
        compress = {**yarn, "rope_theta": compress_theta, "partial_rotary_factor": partial}
        compress.setdefault("rope_type", compress.pop("type", "default"))
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)  # no YaRN mscale, on cos/sin or on the softmax scale
        ropes = {"main": main, "compress": compress}
    for label, rope in ropes.items():
        kind = rope.get("rope_type") or rope.get("type") or "default"
        if kind not in ("default", "yarn"):
            raise ConfigError(
                f"rope_type {kind!r} of the {label} rope (rope_scaling or rope_parameters) is not supported; "
                "DeepSeek-V4.1 uses default or yarn"
            )
        partial = rope.get("partial_rotary_factor")
        if partial is not None and int(head_dim * float(partial)) != rope_dims:
            raise ConfigError(
                f"rope_parameters[{label!r}] rotates head_dim x partial_rotary_factor = {int(head_dim * partial)} "
                f"dims but qk_rope_head_dim is {rope_dims}; make them agree"
            )
        if kind == "yarn":
            missing = [k for k in ("factor", "original_max_position_embeddings") if rope.get(k) is None]
            if missing or float(rope["factor"]) < 1:
                raise ConfigError(
                    f"the {label} rope is YaRN, which needs factor >= 1 and original_max_position_embeddings in "
                    f"rope_scaling (or rope_parameters[{label!r}]); got {rope}"
                )
    return (
        RopeConfig.from_params(ropes["main"], {"rope_theta": theta}),
        RopeConfig.from_params(ropes["compress"], {"rope_theta": compress_theta}),
    )


@dataclass(frozen=True, slots=True)
class DeepseekV41Config:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int  # unused: there is always one shared K = V head
    head_dim: int  # of each query head and of the K = V latent
    q_lora_rank: int
    qk_rope_head_dim: int  # the last dims of each head (and of each index head) are rotated
    rope_theta: float
    compress_rope_theta: float
    rope_main: RopeConfig  # ratio-0 layers
    rope_compress: RopeConfig  # every other layer, its compressor and its indexer
    max_position_embeddings: int
    attention_bias: bool
    attention_dropout: float
    sliding_window: int  # a query sees itself and the sliding_window - 1 tokens before it, on every layer
    compress_ratios: tuple[int, ...]  # num_hidden_layers + num_nextn_predict_layers entries; drafts are 0
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int  # < 0: no two-level top-k
    candidate_topk_blocks: int
    candidate_block_size: int  # compressed entries per candidate block
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    o_groups: int
    o_lora_rank: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int  # always 1: the model has exactly one shared expert whatever config.json says
    num_experts_per_tok: int
    scoring_func: str
    gate_temp: float  # router logits are divided by it before the score function
    norm_topk_prob: bool
    routed_scaling_factor: float
    topk_method: str
    swiglu_limit: float  # applied only when > 0
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    engram_layer_ids: tuple[int, ...]
    engram_vocab_size: int  # the prime search starts here
    engram_num_embeddings: tuple[int, ...]  # rows of each engram layer's table: the sum of its primes
    engram_max_ngram_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_pad_id: int
    engram_compressed_vocab_size: int  # checked against the tokenizer at model build
    num_nextn_predict_layers: int
    dspark_block_size: int
    dspark_noise_token_id: int
    dspark_target_layer_ids: tuple[int, ...]
    dspark_markov_rank: int
    dspark_n_routed_experts: int
    dspark_num_experts_per_tok: int
    hidden_act: str
    initializer_range: float
    rms_norm_eps: float  # 1e-20 in the release, part of the model
    use_cache: bool
    tie_word_embeddings: bool
    pad_token_id: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    output_router_logits: bool
    router_aux_loss_coef: float
    router_jitter_noise: float
    expert_dtype: str | None  # from quantization_config ("fp4": packed e2m1 experts)
    layer_types: tuple[str, ...]
    layers: tuple[LayerPlan, ...]  # one per backbone layer
    ignored_fields: tuple[str, ...]  # config.json keys DeepInfer does not read

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    @property
    def routing(self) -> RoutingConfig:
        """Every layer's: top-k by score + bias (the bias only chooses), weighted by the raw scores,
        normalised only when more than one expert is chosen (the gate's temperature is in its weights)."""
        return RoutingConfig(
            num_experts=self.n_routed_experts,
            top_k=self.num_experts_per_tok,
            method="greedy",
            scoring=self.scoring_func,
            normalize=self.norm_topk_prob and self.num_experts_per_tok > 1,
            routed_scaling_factor=self.routed_scaling_factor,
        )

    def engram_primes(self) -> list[list[list[int]]]:
        """[k-th engram layer][n - 2][head]: the bucket count of each n-gram hash head."""
        return engram_vocab.engram_primes(
            len(self.engram_layer_ids), self.engram_max_ngram_size, self.engram_n_heads, self.engram_vocab_size
        )

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> DeepseekV41Config:
        text, ignored = _text_section(raw)

        def value(name: str) -> Any:
            return _DEFAULTS[name] if text.get(name) is None else text[name]

        def integer(name: str) -> int:
            return _int(name, value(name))

        def number(name: str) -> float:
            try:
                return float(value(name))
            except (TypeError, ValueError):
                raise ConfigError(f"config.json's {name} must be a number; it is {value(name)!r}") from None

        n, n_nextn = integer("num_hidden_layers"), integer("num_nextn_predict_layers")
        if n < 1 or n_nextn < 0:
            raise ConfigError(f"num_hidden_layers ({n}) must be >= 1 and num_nextn_predict_layers ({n_nextn}) >= 0")
        schedule = derive_schedule(
            n,
            n_nextn,
            _ints("compress_ratios", text.get("compress_ratios")),
            _ints("kv_source_layer_ids", text.get("kv_source_layer_ids")),
            _ints("index_source_layer_ids", text.get("index_source_layer_ids")),
            None if text.get("candidate_source_layer_id") is None else integer("candidate_source_layer_id"),
            _ints("dspark_target_layer_ids", text.get("dspark_target_layer_ids")),
        )
        engram_layers = _ints("engram_layer_ids", text.get("engram_layer_ids")) or ()
        engram_rows = _ints("engram_num_embeddings", text.get("engram_num_embeddings"))
        head_dim, rope_dims = integer("head_dim"), integer("qk_rope_head_dim")
        main, compress = _ropes(text, head_dim, rope_dims, number("rope_theta"), number("compress_rope_theta"))
        quant = text.get("quantization_config") or {}
        eos = text.get("eos_token_id", _DEFAULTS["eos_token_id"])  # an explicit null: no end-of-sequence id
        plans = layer_plans(schedule, n, engram_layers)
        config = cls(
            architecture="DeepseekV41ForCausalLM",
            **{name: integer(name) for name in _INT_FIELDS},
            **{name: number(name) for name in _FLOAT_FIELDS},
            **{name: bool(value(name)) for name in _BOOL_FIELDS},
            **{name: str(value(name)) for name in ("scoring_func", "topk_method", "hidden_act")},
            num_hidden_layers=n,
            num_nextn_predict_layers=n_nextn,
            head_dim=head_dim,
            qk_rope_head_dim=rope_dims,
            rope_main=main,
            rope_compress=compress,
            compress_ratios=schedule.compress_ratios,
            kv_source_layer_ids=schedule.kv_source_layer_ids,
            index_source_layer_ids=schedule.index_source_layer_ids,
            candidate_source_layer_id=schedule.candidate_source_layer_id,
            n_shared_experts=1,
            engram_layer_ids=engram_layers,
            engram_num_embeddings=(0,) * len(engram_layers) if engram_rows is None else engram_rows,
            dspark_target_layer_ids=schedule.dspark_target_layer_ids,
            pad_token_id=None if text.get("pad_token_id") is None else integer("pad_token_id"),
            bos_token_id=None if text.get("bos_token_id") is None else integer("bos_token_id"),
            eos_token_ids=_ints("eos_token_id", eos if isinstance(eos, list) else [] if eos is None else [eos]),
            expert_dtype=quant.get("expert_dtype", text.get("expert_dtype")),
            layer_types=tuple(plan.layer_type for plan in plans),
            layers=plans,
            ignored_fields=ignored,
        )
        config._validate(text)
        return config

    def _validate(self, text: dict[str, Any]) -> None:
        problems = []
        for name in (*_INT_FIELDS, "head_dim", "qk_rope_head_dim"):
            if getattr(self, name) < (0 if name in _NON_NEGATIVE else 1):
                problems.append(f"{name} is {getattr(self, name)}; it must be >= {0 if name in _NON_NEGATIVE else 1}")
        if self.scoring_func not in _SCORING:
            problems.append(f"scoring_func {self.scoring_func!r} is not one of {', '.join(_SCORING)}")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            problems.append(f"num_attention_heads x head_dim is not divisible by o_groups {self.o_groups}")
        if self.qk_rope_head_dim % 2:
            problems.append(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even (RoPE rotates pairs of dims)")
        for name in ("head_dim", "index_head_dim"):
            if self.qk_rope_head_dim > getattr(self, name):
                problems.append(f"qk_rope_head_dim {self.qk_rope_head_dim} exceeds {name} {getattr(self, name)}")
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            problems.append(f"num_experts_per_tok must be in 1..n_routed_experts ({self.n_routed_experts})")
        if self.gate_temp <= 0:
            problems.append(f"gate_temp {self.gate_temp} must be > 0 (router logits are divided by it)")
        if not 1 <= self.dspark_num_experts_per_tok <= self.dspark_n_routed_experts:
            problems.append(
                f"dspark_num_experts_per_tok must be in 1..dspark_n_routed_experts ({self.dspark_n_routed_experts})"
            )
        pad = text.get("engram_pad_token_id")
        if pad is not None and pad != self.engram_pad_id:
            problems.append(
                f"engram_pad_token_id {pad} differs from engram_pad_id {self.engram_pad_id}, the key transformers "
                "reads; set engram_pad_id to the padding id and drop engram_pad_token_id"
            )
        problems += self._engram_problems()
        if problems:
            raise ConfigError(
                "config.json describes a DeepSeek-V4.1 model DeepInfer cannot build: " + "; ".join(problems)
            )

    def _engram_problems(self) -> list[str]:
        layers, n = self.engram_layer_ids, self.num_hidden_layers
        if list(layers) != sorted(set(layers)) or any(not 0 <= i < n for i in layers):
            return [f"engram_layer_ids {list(layers)} must be distinct layers in 0..{n - 1}, in increasing order"]
        if len(self.engram_num_embeddings) != len(layers):
            return [
                f"engram_num_embeddings has {len(self.engram_num_embeddings)} entries but engram_layer_ids has "
                f"{len(layers)}; give each engram layer its table's row count"
            ]
        if layers and self.engram_max_ngram_size < 2:
            return [f"engram_max_ngram_size {self.engram_max_ngram_size} must be >= 2 (2-grams and up are hashed)"]
        if not 0 <= self.engram_pad_id < self.vocab_size:
            return [f"engram_pad_id {self.engram_pad_id} is not a token id (0..{self.vocab_size - 1})"]
        if not layers or min(self.engram_n_heads, self.engram_vocab_size) < 1:
            return []
        sums = [sum(map(sum, layer)) for layer in self.engram_primes()]
        if list(self.engram_num_embeddings) != sums:
            return [
                f"engram_num_embeddings {list(self.engram_num_embeddings)} does not match the tables the other "
                f"engram_* fields lay out: each layer's prime buckets sum to {sums} rows; set engram_num_embeddings "
                "to that, or correct engram_vocab_size / engram_max_ngram_size / engram_n_heads"
            ]
        return []
