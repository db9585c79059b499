"""DeepSeek-V4's multi-token prediction (MTP) layer as a drafter for speculative decoding.

What the checkpoint holds (DeepSeek's V4 release, read by its reference `MTPBlock` and vLLM's V4 MTP model):
MTP layer i is stored as `mtp.{i}.*` beside the model (V4 Flash: one, `num_nextn_predict_layers` 1). It is
one more V4 decoder block (`attn_norm`, `ffn_norm`, `hc_attn_*`, `hc_ffn_*`, `attn.*`, `ffn.*`; the
attention's KV norm is spelled `attn.kv_norm`) with its own inputs and head: `enorm`, `hnorm`, `e_proj` and
`h_proj` [D, D], `norm`, and a head mixer `hc_head_fn` [N, N * D], `hc_head_base` [N], `hc_head_scale` [1].
The embedding and the LM head are the model's. The block's attention kind is config.json's entry for layer
num_hidden_layers + i (V4 Flash: compress ratio 0, a sliding-window layer); its MoE is top-k routed.

The math: at position p the layer reads the target's N residual streams after its last layer, before the
head collapse (h_p [N, D]), and the embedding e of the token at p + 1 (zeroed at position 0, as vLLM does).
Every stream starts as e_proj(enorm(e)) + h_proj(hnorm(h_p[n])); the block runs at position p; its own head
mixer collapses the streams, `norm` and the LM head give the logits of the token at p + 2. A further draft
reads the block's output streams as h. Catching up and chaining are model/mtp.py's (`ChainDrafter`); the
block's sliding-window ring is one more layer of per-sequence caches after the model's, whose spare ring
slots keep a verify step's rejected drafts and the chained drafts' writes off every entry a later step reads,
as the model's do (engine/speculative.py bounds the drafts by them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from deepinfer_core.backend.ops import AttentionMetadata
from deepinfer_core.backend.resolve import ResolvedBackend
from deepinfer_core.model.config_v4 import SLIDING, DeepseekV4Config
from deepinfer_core.model.deepseek_v4 import build_layer, hc_mix, layer_weight_shapes, rope_tables_v4, run_layer
from deepinfer_core.model.loader import CheckpointError, StoredTensor
from deepinfer_core.model.mtp import ChainDrafter
from deepinfer_core.model.v4_names import v4_native_name
from deepinfer_core.model.v4_step import V4Step

__all__ = ["MTPDrafterV4", "mtp_layer_config", "mtp_v4_spellings", "mtp_v4_weight_shapes"]


def mtp_layer_config(cfg: DeepseekV4Config, raw: Mapping[str, Any], index: int = 0) -> DeepseekV4Config:
    """MTP layer `index` of the model `cfg` (read from config.json `raw`) as the one layer of a config.

    Its attention kind is the entry for layer num_hidden_layers + index of `layer_types` or the legacy
    `compress_ratios` (sliding when there is none); its MoE is hash-routed only where `mlp_layer_types` or
    `num_hash_layers` (default 3) says so for that layer index."""
    layer = cfg.num_hidden_layers + index
    kinds, ratios = raw.get("layer_types") or [], raw.get("compress_ratios") or []
    if layer < len(kinds):
        kind, found = kinds[layer], f"layer_types[{layer}] = {kinds[layer]!r}"
    elif layer < len(ratios):
        kind, found = SLIDING if ratios[layer] == 0 else None, f"compress_ratios[{layer}] = {ratios[layer]}"
    else:
        kind, found = SLIDING, ""
    if kind != SLIDING:
        raise CheckpointError(
            f"config.json makes the MTP layer a compressed-attention layer ({found}); DeepInfer drafts only with "
            'a sliding-window MTP layer, as DeepSeek-V4 has: use {"method": "ngram"}'
        )
    hashed = raw.get("mlp_layer_types")
    if hashed is not None:
        mlp = hashed[layer] if layer < len(hashed) else "moe"
    else:
        mlp = "hash_moe" if layer < int(raw.get("num_hash_layers", 3)) else "moe"
    return dataclasses.replace(cfg, num_hidden_layers=1, layer_types=(SLIDING,), mlp_layer_types=(mlp,))


def mtp_v4_weight_shapes(cfg: DeepseekV4Config, layer_cfg: DeepseekV4Config, index: int = 0) -> dict:
    """The tensors of MTP layer `index` (its block's kinds from `layer_cfg`, `mtp_layer_config`'s)."""
    d, n, p = cfg.hidden_size, cfg.hc_mult, f"mtp.{index}"
    return {
        f"{p}.enorm.weight": (d,),
        f"{p}.hnorm.weight": (d,),
        f"{p}.e_proj.weight": (d, d),
        f"{p}.h_proj.weight": (d, d),
        f"{p}.norm.weight": (d,),
        f"{p}.hc_head_fn": (n, n * d),
        f"{p}.hc_head_base": (n,),
        f"{p}.hc_head_scale": (1,),
        **layer_weight_shapes(layer_cfg, p, 0),
    }


def mtp_v4_spellings(name: str) -> Sequence[StoredTensor]:
    """For the loader: where a checkpoint keeps an MTP tensor. DeepSeek's spelling of the attention's KV norm
    (`attn.kv_norm.weight`) first, then ours (`attn.norm.weight`); every other name as it is."""
    native = v4_native_name(name)
    return (StoredTensor(native), StoredTensor(name)) if native != name else (StoredTensor(name),)


class MTPDrafterV4(ChainDrafter):
    """Drafts tokens with a DeepSeek-V4 checkpoint's MTP layer; its caches are one more V4 layer's (a ring)."""

    def __init__(
        self,
        model,
        layer_config: DeepseekV4Config,
        weights: Mapping[str, torch.Tensor],
        backend: ResolvedBackend,
        index: int = 0,
    ) -> None:
        cfg: DeepseekV4Config = model.config
        device = backend.torch_device
        w = {name: t.to(device) for name, t in weights.items()}
        p = f"mtp.{index}"
        self.config, self.layer_config, self.ops = cfg, layer_config, backend.ops
        self.block_size = backend.kv_layout.block_size
        self.embed, self.lm_head = model.embed, model.lm_head  # shared with the model
        self.enorm, self.hnorm, self.norm = (w[f"{p}.{name}.weight"] for name in ("enorm", "hnorm", "norm"))
        self.e_proj, self.h_proj = w[f"{p}.e_proj.weight"], w[f"{p}.h_proj.weight"]
        self.head_mix = tuple(w[f"{p}.hc_head_{n}"] for n in ("fn", "scale", "base"))
        self.layer = build_layer(backend, layer_config, w, p, 0, rope_tables_v4(cfg, device))
        self.cache_specs = [self.layer[2].cache_specs]
        # a prefix hit's replay must also rebuild this layer's window, from exact hidden states: one more
        # layer's reach than the model's own replay
        self.replay_tokens = layer_config.sliding_window - 1

    def target_forward(self, model, token_ids, positions, meta, caches) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's final hidden states [T, D] and its last layer's streams [T, N, D], which this reads."""
        streams = model.hidden_streams(token_ids, positions, meta, caches)
        return model.final_hidden(streams), streams

    def forward(
        self,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        caches: list[dict[str, torch.Tensor]],
    ) -> torch.Tensor:
        """next_ids, positions [T], hidden [T, N, D] (the streams at each position) -> the block's output
        streams [T, N, D]; writes the block's ring entries."""
        ops, eps = self.ops, self.config.rms_norm_eps
        embedded = self.embed[next_ids] * (positions != 0)[:, None].to(hidden.dtype)  # position 0: zeroed
        e = ops.linear(ops.rms_norm(embedded, self.enorm, eps), self.e_proj)  # [T, D]
        h = ops.linear(ops.rms_norm(hidden.flatten(0, 1), self.hnorm, eps), self.h_proj).view_as(hidden)
        step = V4Step(meta, positions, self.block_size)
        return run_layer(ops, self.layer_config, self.layer, h + e[:, None, :], step, caches[0], next_ids)

    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        """The block's output streams [rows, N, D] -> logits [rows, V] float32 (of the token after the next)."""
        collapsed, _, _ = hc_mix(self.ops, self.config, streams, self.head_mix)
        hidden = self.ops.rms_norm(collapsed, self.norm, self.config.rms_norm_eps)
        return self.ops.linear(hidden, self.lm_head).float()

    def draft_tokens(self, out: torch.Tensor) -> torch.Tensor:
        """The block's output streams [rows, N, D] -> greedy drafts [rows]."""
        return self.logits(out).argmax(-1)
