"""The DeepSeek-V4.1 decoder: single-pass hyper-connections, CED + CSA2 attention over group-shared
compressed KV, Engram n-gram memory, and top-k MoE routed at a temperature (docs/deepseek_v41_reference.md).

Single-device model code over the backend contract (V4_OPS and V41_OPS besides the base ones). Weight
names are those transformers' DeepseekV41ForCausalLM writes (DeepSeek's module names under `model.`).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from deepinfer_core.backend.ops import V4_OPS, V41_OPS, AttentionMetadata, RoutingConfig
from deepinfer_core.backend.resolve import ResolvedBackend
from deepinfer_core.kv.layout import CacheKind
from deepinfer_core.model import engram_vocab
from deepinfer_core.model.config_v41 import DeepseekV41Config
from deepinfer_core.model.deepseek_v4 import UnsupportedModelError
from deepinfer_core.model.layers import DenseMLP, MoE
from deepinfer_core.model.rope import rotary_tables
from deepinfer_core.model.v4_attention import ROLLBACK_SLOTS
from deepinfer_core.model.v4_step import V4Step
from deepinfer_core.model.v41_attention import SharedIndices, V41Attention
from deepinfer_core.model.v41_engram import ENGRAM_STATE, EngramLayer, EngramTables, NgramHasher
from deepinfer_core.model.v41_skip import layer_starts

__all__ = [
    "DeepseekV41Model",
    "FLOAT32_WEIGHTS_V41",
    "engram_tables_kept",
    "expected_weights_v41",
    "hc_mixes",
    "moe_shapes",
    "v41_moe",
    "window_attention_shapes",
]

# Kept float32 whatever the compute dtype, as in the checkpoints: hyper-connection mixers, attention
# sinks, routers and their biases.
FLOAT32_WEIGHTS_V41 = re.compile(r"(\.hc_\w+|\.attn_sink|\.ffn\.gate\.(weight|bias))$")
_DENSE_ENGRAM = "engram.embed.weight"
_ENGRAM_TABLE = re.compile(r"\.engram\.embed\.weight$")


def engram_tables_kept(keep: dict) -> dict:
    """The loader's keep_quantized plus the Engram tables in FP8, whatever the backend takes: they are only ever
    gathered (EngramTables dequantizes the rows a step reads), never an op's weight."""
    fp8 = keep.get("fp8_block")
    pattern = _ENGRAM_TABLE if fp8 is None else re.compile(f"(?:{fp8.pattern})|(?:{_ENGRAM_TABLE.pattern})")
    return {**keep, "fp8_block": pattern}


def window_attention_shapes(cfg: DeepseekV41Config, p: str) -> dict[str, tuple[int, ...]]:
    """A window-only attention layer's tensors (every layer has these)."""
    d, heads, dh = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    return {
        f"{p}.wq_a.weight": (cfg.q_lora_rank, d),
        f"{p}.q_norm.weight": (cfg.q_lora_rank,),
        f"{p}.wq_b.weight": (heads * dh, cfg.q_lora_rank),
        f"{p}.wkv.weight": (dh, d),
        f"{p}.kv_norm.weight": (dh,),
        f"{p}.wo_a.weight": (cfg.o_groups * cfg.o_lora_rank, heads * dh // cfg.o_groups),
        f"{p}.wo_b.weight": (d, cfg.o_groups * cfg.o_lora_rank),
        f"{p}.attn_sink": (heads,),
    }


def _attention_shapes(cfg: DeepseekV41Config, p: str, layer: int) -> dict[str, tuple[int, ...]]:
    d, dh, plan = cfg.hidden_size, cfg.head_dim, cfg.layers[layer]
    shapes = window_attention_shapes(cfg, p)
    di = cfg.index_head_dim
    if plan.is_kv_source:
        shapes |= {f"{p}.compressor.wkv.weight": (dh, d), f"{p}.compressor.norm.weight": (dh,)}
        if plan.ratio > 1:
            shapes[f"{p}.compressor.wgate.weight"] = (dh, d)
    if plan.owns_index_keys:
        shapes |= {f"{p}.indexer.wk.weight": (di, dh), f"{p}.indexer.k_norm.weight": (di,)}
    if plan.is_index_source:
        shapes[f"{p}.indexer.wq_b.weight"] = (cfg.index_n_heads * di, cfg.q_lora_rank)
        shapes[f"{p}.indexer.weights_proj.weight"] = (cfg.index_n_heads, d)
    return shapes


def moe_shapes(cfg: DeepseekV41Config, p: str, experts: int) -> dict[str, tuple[int, ...]]:
    """A MoE of `experts` routed experts and a shared one."""
    d, inner = cfg.hidden_size, cfg.moe_intermediate_size
    shapes = {f"{p}.gate.weight": (experts, d), f"{p}.gate.bias": (experts,)}
    for expert in [f"experts.{e}" for e in range(experts)] + ["shared_experts"]:
        shapes |= {f"{p}.{expert}.w1.weight": (inner, d), f"{p}.{expert}.w3.weight": (inner, d)}
        shapes[f"{p}.{expert}.w2.weight"] = (d, inner)
    return shapes


def v41_moe(backend: ResolvedBackend, cfg: DeepseekV41Config, w: dict, p: str, routing: RoutingConfig) -> MoE:
    """The MoE at `p` (routing.num_experts routed experts and a shared one), computed as the reference does."""
    limit = cfg.swiglu_limit or None

    def mlp(prefix: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return w[f"{prefix}.w1.weight"], w[f"{prefix}.w3.weight"], w[f"{prefix}.w2.weight"]  # gate, up, down

    experts = [mlp(f"{p}.experts.{e}") for e in range(routing.num_experts)]
    shared = DenseMLP(backend, *mlp(f"{p}.shared_experts"), limit, float_activation=True)  # as the reference
    gate = w[f"{p}.gate.weight"].float() / cfg.gate_temp  # logits at the router's temperature
    return MoE(backend, routing, gate, w[f"{p}.gate.bias"], experts, shared, limit=limit, weight_before_down=True)


def hc_mixes(ops, cfg: DeepseekV41Config, streams: torch.Tensor, mixer: tuple):
    """A layer's hyper-connection mixer (fn, scale, base) over streams [T, N, D] -> ops.hc_mixes' (pre, post,
    comb)."""
    fn, scale, base = mixer
    return ops.hc_mixes(
        streams, fn, scale, base, sinkhorn_iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps
    )


def expected_weights_v41(cfg: DeepseekV41Config) -> dict[str, tuple[int, ...]]:
    """Every tensor the model reads, with the shape the config implies."""
    d, n = cfg.hidden_size, cfg.hc_mult
    mixes = (2 + n) * n
    shapes = {"model.embed.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    columns = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes |= {f"{p}.attn_norm.weight": (d,), f"{p}.ffn_norm.weight": (d,)}
        for site in ("attn", "ffn"):
            hc = f"{p}.hc_{site}"
            shapes |= {f"{hc}_fn": (mixes, n * d), f"{hc}_base": (mixes,), f"{hc}_scale": (3,)}
        shapes |= _attention_shapes(cfg, f"{p}.attn", i)
        shapes |= moe_shapes(cfg, f"{p}.ffn", cfg.n_routed_experts)
        if cfg.layers[i].engram:
            k = list(cfg.engram_layer_ids).index(i)
            shapes |= {
                f"{p}.{_DENSE_ENGRAM}": (cfg.engram_num_embeddings[k], cfg.engram_head_dim),
                f"{p}.engram.wkv.weight": ((n + 1) * d, columns * cfg.engram_head_dim),
                f"{p}.engram.q_weight": (n, d),
                f"{p}.engram.k_weight": (n, d),
            }
    return shapes


def check_backend(cfg: DeepseekV41Config, backend: ResolvedBackend) -> None:
    """Raise UnsupportedModelError naming what the backend lacks for this model, and why."""
    caps, name = backend.capabilities, backend.info.name
    needed = [op for op in V4_OPS if op not in ("hash_routing", "hc_pre", "hc_post", "indexer_topk")] + list(V41_OPS)
    missing = [f"{op} ({reason})" for op in needed if (reason := caps.supports(op)) is not True]
    kinds = {CacheKind.PAGED, CacheKind.SLIDING_WINDOW, CacheKind.SEQUENCE_STATE}
    missing += [f"{kind.value} caches" for kind in sorted(kinds - set(caps.cache_kinds), key=lambda k: k.value)]
    if missing:
        raise UnsupportedModelError(
            f"backend {name} cannot run DeepSeek-V4.1: it lacks {'; '.join(missing)}. "
            "Run it on a backend that has them (the cpu reference backend has every one)."
        )
    block = backend.kv_layout.block_size
    for ratio in {plan.ratio for plan in cfg.layers if plan.is_kv_source}:
        if block % ratio:
            raise UnsupportedModelError(
                f"KV block size {block} is not a multiple of the compress ratio {ratio}: choose a block size "
                "the ratios divide (the backend's block_sizes)"
            )


class DeepseekV41Model:
    """Holds the weights on the backend's device (the engram tables where `engram_placement` puts them: one of
    v41_engram.ENGRAM_PLACEMENTS) and runs one step over a ragged batch."""

    def __init__(
        self,
        config: DeepseekV41Config,
        weights: dict[str, torch.Tensor],
        backend: ResolvedBackend,
        token_map: list[int] | None = None,
        engram_placement: str = "auto",
    ) -> None:
        check_backend(config, backend)
        device = backend.torch_device
        table_names = [f"model.layers.{i}.{_DENSE_ENGRAM}" for i in config.engram_layer_ids]
        w = {name: t.to(device) for name, t in weights.items() if name not in table_names}  # tables: below
        self.config, self.backend, self.ops = config, backend, backend.ops
        self.block_size = backend.kv_layout.block_size
        self.replay_tokens = _replay_tokens(config)
        ropes = {
            name: tuple(
                t.to(device) for t in rotary_tables(rope, config.qk_rope_head_dim, config.max_position_embeddings)
            )
            for name, rope in (("main", config.rope_main), ("compress", config.rope_compress))
        }
        self.embed = w["model.embed.weight"]  # [V, D]
        self.norm = w["model.norm.weight"]
        self.lm_head = self.embed if config.tie_word_embeddings else w["lm_head.weight"]
        self.hasher = self.engram_tables = None
        if config.engram_layer_ids:
            if token_map is None:
                raise UnsupportedModelError("DeepSeek-V4.1's engram layers need the tokenizer's compressed vocabulary")
            self.hasher = NgramHasher(backend, config, token_map)
            self.engram_tables = EngramTables.place([weights[n] for n in table_names], engram_placement, backend)
        # decode steps are planned on the device (V4Step) and replayed from device graphs, unless the engram
        # tables are in host memory (their rows are gathered on the host, after the step's hashes are read)
        self.graph_capture = self.engram_tables is None or not self.engram_tables.on_host
        self.layers = []
        attentions: dict[int, V41Attention] = {}
        for i, plan in enumerate(config.layers):
            p = f"model.layers.{i}"
            mixers = [tuple(w[f"{p}.hc_{site}_{n}"] for n in ("fn", "scale", "base")) for site in ("attn", "ffn")]
            source = attentions.get(plan.kv_source) if plan.kv_source is not None else None
            attention = attentions[i] = V41Attention(backend, config, w, f"{p}.attn", plan, ropes, source)
            engram = None
            if plan.engram:
                engram = EngramLayer(backend, config, w, f"{p}.engram", list(config.engram_layer_ids).index(i))
            norms = (w[f"{p}.attn_norm.weight"], w[f"{p}.ffn_norm.weight"])
            ffn = v41_moe(backend, config, w, f"{p}.ffn", config.routing)
            self.layers.append((mixers, norms, attention, ffn, engram))
        self.cache_specs = [dict(attention.cache_specs) for _, _, attention, _, _ in self.layers]
        if self.hasher is not None:  # the look-back lives with the first engram layer's caches
            self.cache_specs[config.engram_layer_ids[0]][ENGRAM_STATE] = self.hasher.state_spec
        # speculative decoding: rejected drafts land in the rings' and states' spare rows (v4_attention)
        self.speculative_max_drafts = ROLLBACK_SLOTS
        # a draft model (DSpark) reads the mean of the streams entering these layers: forward leaves them in
        # `taps` [T, len(tap_layers) x D], in that order (zeros for tokens a layer skipped)
        self.tap_layers: tuple[int, ...] = ()
        self.taps: torch.Tensor | None = None

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
        """token_ids, positions [T] -> final hidden states [T, D]; reads and writes every layer's caches.

        With `meta.needed_from`, each layer processes only the tokens a needed position depends on
        (v41_skip.py): the rows before a sequence's needed_from mean nothing then, and those of tokens that
        skipped the last layer are zeros.
        """
        ops, cfg, eps = self.ops, self.config, self.config.rms_norm_eps
        step = V4Step(meta, positions, self.block_size)
        starts = None  # per layer, per sequence: its first position the layer processes
        if meta.needed_from is not None and not meta.uniform_decode and positions.shape[0] > meta.num_seqs:
            starts = layer_starts(cfg, meta.needed_from.tolist(), meta.cached_lens.tolist())
        rows = None  # the input rows the layers still process, once fewer than all
        streams = self.embed[token_ids][:, None, :].expand(-1, cfg.hc_mult, -1).contiguous()  # [T, N, D]
        engram_rows = None
        if self.hasher is not None:
            hashes = self.hasher(token_ids, step, caches[cfg.engram_layer_ids[0]][ENGRAM_STATE])
            engram_rows = self.engram_tables.gather(hashes)  # per engram layer [T, columns x engram_head_dim]
        # the first attention input is the embedding: a one-hot collapse onto stream 0
        pre = torch.zeros(streams.shape[:2], dtype=torch.float32, device=streams.device)
        pre[:, 0] = 1.0
        shared = SharedIndices()
        d = cfg.hidden_size
        self.taps = streams.new_zeros(positions.shape[0], len(self.tap_layers) * d) if self.tap_layers else None
        for i, (mixers, (attn_norm, ffn_norm), attention, moe, engram) in enumerate(self.layers):
            if starts is not None:
                step, keep = step.suffix(starts[i])
                if keep is not None:
                    if not step.num_tokens:
                        return streams.new_zeros(positions.shape[0], cfg.hidden_size)
                    streams, pre, token_ids, shared = streams[keep], pre[keep], token_ids[keep], shared.rows(keep)
                    rows = keep if rows is None else rows[keep]
            if engram is not None:
                table_rows = engram_rows[engram.index]
                streams = engram(streams, table_rows if rows is None else table_rows[rows])
            if i in self.tap_layers:  # the stream mean entering the layer (its engram's included)
                k = self.tap_layers.index(i)
                columns, mean = self.taps[:, k * d : (k + 1) * d], streams.mean(dim=1)  # [T, D], [T', D]
                if rows is None:
                    columns.copy_(mean)
                else:
                    columns.index_copy_(0, rows, mean)
            attn_pre, post, comb = hc_mixes(ops, cfg, streams, mixers[0])
            x = ops.rms_norm(ops.hc_collapse(streams, pre), attn_norm, eps)
            group = caches[attention.plan.kv_source] if attention.plan.kv_source is not None else None
            streams = ops.hc_expand(attention(x, step, caches[i], group, shared), streams, post, comb)
            pre, post, comb = hc_mixes(ops, cfg, streams, mixers[1])
            x = ops.rms_norm(ops.hc_collapse(streams, attn_pre), ffn_norm, eps)
            streams = ops.hc_expand(moe(x, token_ids), streams, post, comb)
        hidden = ops.rms_norm(ops.hc_collapse(streams, pre), self.norm, eps)  # [T', D]
        if rows is None:
            return hidden
        return hidden.new_zeros(positions.shape[0], cfg.hidden_size).index_copy_(0, rows, hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> logits [N, V] float32."""
        return self.ops.linear(hidden, self.lm_head).float()


def _replay_tokens(cfg: DeepseekV41Config) -> int:
    """Tokens recomputed before a cached prefix to rebuild the windows, partial groups and the engram
    look-back exactly: as V4, every layer's window reads window - 1 earlier inputs of the layer below;
    the first replayed tokens (whose own look-back is unknown) are that far out of reach."""
    ratios = [plan.ratio for plan in cfg.layers]
    reach = max(cfg.sliding_window - 1, max(ratios, default=0) - 1, cfg.engram_max_ngram_size - 1)
    return (cfg.num_hidden_layers - 1) * (cfg.sliding_window - 1) + reach


def token_map_for(cfg: DeepseekV41Config, checkpoint: Path) -> list[int] | None:
    """The compressed vocabulary of the checkpoint's tokenizer.json when the model has engram layers."""
    if not cfg.engram_layer_ids:
        return None
    file = checkpoint / "tokenizer.json"
    if not file.is_file():
        raise UnsupportedModelError(
            f"{checkpoint} has engram layers but no tokenizer.json: their hashes are built from the tokenizer's "
            "vocabulary; put the model's tokenizer.json beside its config.json"
        )
    return engram_vocab.check_compressed_vocabulary(cfg, file)
