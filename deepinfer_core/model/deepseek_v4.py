"""The DeepSeek-V4 decoder (V4 / V4.1 Flash): hyper-connected residual streams, sliding / CSA / HCA
attention, hash-routed and top-k routed MoE with sqrtsoftplus scores and a clamped SwiGLU.

Single-device model code over the backend contract (the ops in `V4_OPS` besides the base ones). Weight
names are those of DeepSeek's checkpoints, which transformers' `save_pretrained` also writes.
"""

from __future__ import annotations

import re

import torch

from deepinfer_core.backend.ops import V4_OPS, AttentionMetadata
from deepinfer_core.backend.resolve import ResolvedBackend
from deepinfer_core.errors import DeepInferError
from deepinfer_core.kv.layout import CacheKind
from deepinfer_core.model.config_v4 import CSA, SLIDING, DeepseekV4Config
from deepinfer_core.model.layers import DenseMLP, MoE
from deepinfer_core.model.rope import rotary_tables
from deepinfer_core.model.v4_attention import ROLLBACK_SLOTS, V4Attention
from deepinfer_core.model.v4_step import V4Step

__all__ = [
    "DeepseekV4Model",
    "FLOAT32_WEIGHTS_V4",
    "QUANTIZED_WEIGHTS_V4",
    "UnsupportedModelError",
    "expected_weights_v4",
]

# Kept float32 whatever the compute dtype, as in the checkpoints: hyper-connection mixers, attention
# sinks, compressor position biases, routers.
FLOAT32_WEIGHTS_V4 = re.compile(r"(\.hc_\w+|\.hc_head\.\w+|\.attn_sink|\.ape|\.ffn\.gate\.(weight|bias))$")
# Weights only `linear` / `expert_ffn` read, by the format a backend may keep them in (loader.load_tensors), for
# V4, V4.1, their MTP and DSpark layers: FP8 projections and experts, FP4 routed experts. wo_a goes through
# head_linear and the compressors' projections are concatenated (V4.1: in float32): always dequantized.
QUANTIZED_WEIGHTS_V4 = {
    "fp8_block": re.compile(
        r"(\.attn\.(wq_a|wq_b|wkv|wo_b|indexer\.wq_b)|\.ffn\.(shared_experts|experts\.\d+)\.w[123]|\.[eh]_proj)\.weight$"
    ),
    "mxfp4": re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$"),
}


class UnsupportedModelError(DeepInferError):
    """The selected backend cannot run this model (an op or cache kind it lacks, a block size)."""


def _attention_shapes(cfg: DeepseekV4Config, p: str, layer: int) -> dict[str, tuple[int, ...]]:
    d, heads, dh = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    shapes = {
        f"{p}.wq_a.weight": (cfg.q_lora_rank, d),
        f"{p}.q_norm.weight": (cfg.q_lora_rank,),
        f"{p}.wq_b.weight": (heads * dh, cfg.q_lora_rank),
        f"{p}.wkv.weight": (dh, d),
        f"{p}.norm.weight": (dh,),
        f"{p}.wo_a.weight": (cfg.o_groups * cfg.o_lora_rank, heads * dh // cfg.o_groups),
        f"{p}.wo_b.weight": (d, cfg.o_groups * cfg.o_lora_rank),
        f"{p}.attn_sink": (heads,),
    }
    kind, rate = cfg.layer_types[layer], cfg.rate(layer)

    def compressor(prefix: str, head_dim: int, width: int) -> dict[str, tuple[int, ...]]:
        return {
            f"{prefix}.wkv.weight": (width, d),
            f"{prefix}.wgate.weight": (width, d),
            f"{prefix}.ape": (rate, width),
            f"{prefix}.norm.weight": (head_dim,),
        }

    if kind != SLIDING:
        shapes |= compressor(f"{p}.compressor", dh, 2 * dh if kind == CSA else dh)
    if kind == CSA:
        di = cfg.index_head_dim
        shapes |= compressor(f"{p}.indexer.compressor", di, 2 * di)
        shapes[f"{p}.indexer.wq_b.weight"] = (cfg.index_n_heads * di, cfg.q_lora_rank)
        shapes[f"{p}.indexer.weights_proj.weight"] = (cfg.index_n_heads, d)
    return shapes


def _ffn_shapes(cfg: DeepseekV4Config, p: str, layer: int) -> dict[str, tuple[int, ...]]:
    d, inner = cfg.hidden_size, cfg.moe_intermediate_size
    shapes = {f"{p}.gate.weight": (cfg.n_routed_experts, d)}
    if cfg.mlp_layer_types[layer] == "hash_moe":
        shapes[f"{p}.gate.tid2eid"] = (cfg.vocab_size, cfg.num_experts_per_tok)
    else:
        shapes[f"{p}.gate.bias"] = (cfg.n_routed_experts,)
    for expert in [f"experts.{e}" for e in range(cfg.n_routed_experts)] + ["shared_experts"]:
        shapes |= {f"{p}.{expert}.w1.weight": (inner, d), f"{p}.{expert}.w3.weight": (inner, d)}
        shapes[f"{p}.{expert}.w2.weight"] = (d, inner)
    return shapes


def layer_weight_shapes(cfg: DeepseekV4Config, prefix: str, layer: int) -> dict[str, tuple[int, ...]]:
    """The tensors of decoder layer `layer` of `cfg` (its attention and MoE kinds), named under `prefix`."""
    d, n = cfg.hidden_size, cfg.hc_mult
    mixes = (2 + n) * n
    shapes = {f"{prefix}.attn_norm.weight": (d,), f"{prefix}.ffn_norm.weight": (d,)}
    for block in ("attn", "ffn"):
        shapes |= {
            f"{prefix}.hc_{block}_fn": (mixes, n * d),
            f"{prefix}.hc_{block}_base": (mixes,),
            f"{prefix}.hc_{block}_scale": (3,),
        }
    return shapes | _attention_shapes(cfg, f"{prefix}.attn", layer) | _ffn_shapes(cfg, f"{prefix}.ffn", layer)


def expected_weights_v4(cfg: DeepseekV4Config) -> dict[str, tuple[int, ...]]:
    """Every tensor the model reads, with the shape the config implies."""
    d, n = cfg.hidden_size, cfg.hc_mult
    shapes = {
        "model.embed_tokens.weight": (cfg.vocab_size, d),
        "model.norm.weight": (d,),
        "model.hc_head.hc_fn": (n, n * d),
        "model.hc_head.hc_base": (n,),
        "model.hc_head.hc_scale": (1,),
    }
    if not cfg.tie_word_embeddings:
        shapes["head.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.num_hidden_layers):
        shapes |= layer_weight_shapes(cfg, f"model.layers.{i}", i)
    return shapes


def check_backend(cfg: DeepseekV4Config, backend: ResolvedBackend) -> None:
    """Raise UnsupportedModelError naming what the backend lacks for this model, and why."""
    caps, name = backend.capabilities, backend.info.name
    missing = [f"{op} ({reason})" for op in V4_OPS if (reason := caps.supports(op)) is not True]
    kinds = {CacheKind.PAGED, CacheKind.SLIDING_WINDOW, CacheKind.SEQUENCE_STATE}
    missing += [f"{kind.value} caches" for kind in sorted(kinds - set(caps.cache_kinds), key=lambda k: k.value)]
    if missing:
        raise UnsupportedModelError(
            f"backend {name} cannot run DeepSeek-V4: it lacks {'; '.join(missing)}. "
            "Run it on a backend that has them (the cpu reference backend has every one)."
        )
    block = backend.kv_layout.block_size
    for kind in set(cfg.layer_types) - {SLIDING}:
        if block % cfg.compress_rates[kind]:
            raise UnsupportedModelError(
                f"KV block size {block} is not a multiple of the {kind} compress rate {cfg.compress_rates[kind]}: "
                "choose a block size the rates divide (the backend's block_sizes)"
            )


def rope_tables_v4(cfg: DeepseekV4Config, device: torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The two rotary tables (cos, sin) on `device`: "main" (sliding layers), "compress" (compressed ones)."""
    return {
        name: tuple(t.to(device) for t in rotary_tables(rope, cfg.qk_rope_head_dim, cfg.max_position_embeddings))
        for name, rope in (("main", cfg.rope_main), ("compress", cfg.rope_compress))
    }


def build_layer(backend: ResolvedBackend, cfg: DeepseekV4Config, w: dict, prefix: str, layer: int, ropes: dict):
    """Decoder layer `layer` of `cfg` from the weights named under `prefix` -> (mixers (attn, ffn), norms
    (attn, ffn), V4Attention, MoE), as `run_layer` reads it."""
    mixers = [tuple(w[f"{prefix}.hc_{block}_{n}"] for n in ("fn", "scale", "base")) for block in ("attn", "ffn")]
    return (
        mixers,
        (w[f"{prefix}.attn_norm.weight"], w[f"{prefix}.ffn_norm.weight"]),
        V4Attention(backend, cfg, w, f"{prefix}.attn", layer, ropes),
        _moe(backend, cfg, w, f"{prefix}.ffn", layer),
    )


def _moe(backend: ResolvedBackend, cfg: DeepseekV4Config, w: dict, p: str, layer: int) -> MoE:
    limit = cfg.swiglu_limit

    def mlp(prefix: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return w[f"{prefix}.w1.weight"], w[f"{prefix}.w3.weight"], w[f"{prefix}.w2.weight"]  # gate, up, down

    experts = [mlp(f"{p}.experts.{e}") for e in range(cfg.n_routed_experts)]
    shared = DenseMLP(backend, *mlp(f"{p}.shared_experts"), limit)
    return MoE(
        backend,
        cfg.routing(layer),
        w[f"{p}.gate.weight"],
        w.get(f"{p}.gate.bias"),
        experts,
        shared,
        limit=limit,
        hash_table=w.get(f"{p}.gate.tid2eid"),
    )


def hc_mix(ops, cfg: DeepseekV4Config, streams: torch.Tensor, mixer: tuple):
    """A hyper-connection mixer (fn, scale, base) applied to streams [T, N, D] -> (collapsed [T, D], post,
    comb); post and comb are None for a head mixer (fn [N, N * D])."""
    fn, scale, base = mixer
    return ops.hc_pre(
        streams, fn, scale, base, sinkhorn_iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps
    )


def run_layer(
    ops, cfg: DeepseekV4Config, layer: tuple, streams: torch.Tensor, step: V4Step, cache: dict, token_ids: torch.Tensor
) -> torch.Tensor:
    """One decoder layer (`build_layer`'s) over streams [T, N, D] -> the new streams [T, N, D]: attention, then
    MoE (hash-routed by token_ids [T] where it is), each a hyper-connected residual half-layer."""
    (attn_mix, ffn_mix), (attn_norm, ffn_norm), attention, moe = layer
    eps = cfg.rms_norm_eps
    collapsed, post, comb = hc_mix(ops, cfg, streams, attn_mix)
    streams = ops.hc_post(attention(ops.rms_norm(collapsed, attn_norm, eps), step, cache), streams, post, comb)
    collapsed, post, comb = hc_mix(ops, cfg, streams, ffn_mix)
    return ops.hc_post(moe(ops.rms_norm(collapsed, ffn_norm, eps), token_ids), streams, post, comb)


class DeepseekV4Model:
    """Holds the weights on the backend's device and runs one step over a ragged batch."""

    graph_capture = True  # decode steps are planned on the device (V4Step) and replayed from device graphs

    def __init__(self, config: DeepseekV4Config, weights: dict[str, torch.Tensor], backend: ResolvedBackend) -> None:
        check_backend(config, backend)
        device = backend.torch_device
        w = {name: t.to(device) for name, t in weights.items()}
        self.config, self.backend, self.ops = config, backend, backend.ops
        self.block_size = backend.kv_layout.block_size
        self.replay_tokens = config.replay_tokens
        ropes = rope_tables_v4(config, device)
        self.embed = w["model.embed_tokens.weight"]  # [V, D]
        self.norm = w["model.norm.weight"]
        self.lm_head = self.embed if config.tie_word_embeddings else w["head.weight"]
        self.head_mix = tuple(w[f"model.hc_head.hc_{n}"] for n in ("fn", "scale", "base"))
        self.layers = [
            build_layer(backend, config, w, f"model.layers.{i}", i, ropes) for i in range(config.num_hidden_layers)
        ]
        self.cache_specs = [attention.cache_specs for _, _, attention, _ in self.layers]
        # speculative decoding: rejected drafts land in the rings' and states' spare rows (v4_attention)
        self.speculative_max_drafts = ROLLBACK_SLOTS

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
        """token_ids, positions [T] -> final hidden states [T, D]; reads and writes every layer's caches."""
        return self.final_hidden(self.hidden_streams(token_ids, positions, meta, caches))

    def hidden_streams(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        caches: list[dict[str, torch.Tensor]],
    ) -> torch.Tensor:
        """token_ids, positions [T] -> the last layer's residual streams [T, N, D] (before the head collapse);
        reads and writes every layer's caches."""
        step = V4Step(meta, positions, self.block_size)
        streams = self.embed[token_ids][:, None, :].expand(-1, self.config.hc_mult, -1).contiguous()  # [T, N, D]
        for layer, cache in zip(self.layers, caches):
            streams = run_layer(self.ops, self.config, layer, streams, step, cache, token_ids)
        return streams

    def final_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """The last layer's streams [T, N, D] -> final hidden states [T, D]: head collapse, final norm."""
        collapsed, _, _ = hc_mix(self.ops, self.config, streams, self.head_mix)
        return self.ops.rms_norm(collapsed, self.norm, self.config.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> logits [N, V] float32."""
        return self.ops.linear(hidden, self.lm_head).float()
