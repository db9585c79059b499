"""DeepSeek-V4.1's DSpark draft model: drafts a block of tokens in one pass, with a confidence for each.

The checkpoint's `mtp.{0..S-1}` (S = num_nextn_predict_layers, released: 3) are V4.1 blocks run one after
another over a block of k positions: hyper-connected streams (the first attention input a one-hot collapse
onto stream 0, as the backbone's; no hc_head: the last FFN mixer's pre collapses the output), window-only
attention, and a MoE of dspark_n_routed_experts top-dspark_num_experts_per_tok plus a shared expert.

- Context: the mean over the streams entering each backbone layer of `dspark_target_layer_ids` (after its
  engram), concatenated, projected and normed (`mtp.0.main_proj`, `main_norm`): one vector per position.
  Each stage keeps a window ring of its own K = V entries of these vectors (its wkv, kv_norm, rope), written
  for every position the target computes, as the target writes its rings (rejected drafts land in the
  spare slots past the window).
- The block: the token sampled after the last accepted position (the anchor, at position P) and k - 1
  `dspark_noise_token_id` fillers at P + 1 .. P + k - 1, embedded with the backbone's table. Every row
  attends to the stage's ring entries of positions P - window .. P - 1 and to all k rows of the block in
  both directions (`block_attention`); the block's entries are never written to the ring.
- Row j's logits (backbone head over `mtp.{S-1}.norm` of its hidden) predict the token at P + 1 + j. The
  Markov head adds `head(embed(previous token))` (rank dspark_markov_rank) to each row in turn, the previous
  token being the anchor for row 0 and row j - 1's draft after; drafts are greedy. The confidence head
  reads [hidden before the norm, embed(previous token)] and gives sigmoid(proj(.)) = the probability that
  row j's draft is accepted given the ones before it were.

Facts from DeepSeek's V4.1 inference code as vLLM and SGLang implement it (read, not copied).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from deepinfer_core.backend.ops import AttentionMetadata
from deepinfer_core.backend.resolve import ResolvedBackend
from deepinfer_core.model.config_v41 import DeepseekV41Config, LayerPlan
from deepinfer_core.model.deepseek_v4 import QUANTIZED_WEIGHTS_V4, UnsupportedModelError
from deepinfer_core.model.deepseek_v41 import (
    FLOAT32_WEIGHTS_V41,
    hc_mixes,
    moe_shapes,
    v41_moe,
    window_attention_shapes,
)
from deepinfer_core.model.loader import CheckpointError, kept_formats, load_tensors
from deepinfer_core.model.rope import rotary_tables
from deepinfer_core.model.v4_step import V4Step
from deepinfer_core.model.v41_attention import V41Attention
from deepinfer_core.model.v41_names import v41_spellings

__all__ = ["DSparkDrafter", "dspark_weight_shapes", "load_dspark"]

_WINDOW_ONLY = LayerPlan(
    layer=-1, ratio=0, kv_source=None, index_source=None, is_kv_source=False, is_index_source=False,
    owns_index_keys=False, reindex=False, is_candidate_source=False, uses_candidates=False, rope="main",
    engram=False, layer_type="sliding_attention",
)  # fmt: skip


def dspark_weight_shapes(cfg: DeepseekV41Config) -> dict[str, tuple[int, ...]]:
    """Every DSpark tensor (our names; DeepSeek's checkpoints drop the `model.` prefix), shapes from cfg."""
    d, n, stages = cfg.hidden_size, cfg.hc_mult, cfg.num_nextn_predict_layers
    mixes, rank = (2 + n) * n, cfg.dspark_markov_rank
    shapes = {
        "model.mtp.0.main_proj.weight": (d, len(cfg.dspark_target_layer_ids) * d),
        "model.mtp.0.main_norm.weight": (d,),
    }
    for i in range(stages):
        p = f"model.mtp.{i}"
        shapes |= {f"{p}.attn_norm.weight": (d,), f"{p}.ffn_norm.weight": (d,)}
        for site in ("attn", "ffn"):
            hc = f"{p}.hc_{site}"
            shapes |= {f"{hc}_fn": (mixes, n * d), f"{hc}_base": (mixes,), f"{hc}_scale": (3,)}
        shapes |= window_attention_shapes(cfg, f"{p}.attn")
        shapes |= moe_shapes(cfg, f"{p}.ffn", cfg.dspark_n_routed_experts)
    last = f"model.mtp.{stages - 1}"
    return shapes | {
        f"{last}.norm.weight": (d,),
        f"{last}.markov_head.embed.weight": (cfg.vocab_size, rank),
        f"{last}.markov_head.head.weight": (cfg.vocab_size, rank),
        f"{last}.confidence_head.proj.weight": (1, d + rank),
    }


class DSparkDrafter:
    """Drafts k tokens per request with a V4.1 checkpoint's DSpark layers; its caches: one window ring per
    stage. `draft` returns the drafts and each one's conditional acceptance probability."""

    def __init__(self, model, weights: Mapping[str, torch.Tensor], backend: ResolvedBackend) -> None:
        cfg: DeepseekV41Config = model.config
        device = backend.torch_device
        w = {name: t.to(device) for name, t in weights.items()}
        self.config, self.model, self.ops, self.attention = cfg, model, backend.ops, backend.attention
        self.layout, self.block_size, self.eps = backend.kv_layout, backend.kv_layout.block_size, cfg.rms_norm_eps
        model.tap_layers = tuple(cfg.dspark_target_layer_ids)  # the backbone leaves their inputs in model.taps
        ropes = {"main": tuple(t.to(device) for t in rotary_tables(cfg.rope_main, cfg.qk_rope_head_dim,
                                                                    cfg.max_position_embeddings))}  # fmt: skip
        self.main_proj, self.main_norm = w["model.mtp.0.main_proj.weight"], w["model.mtp.0.main_norm.weight"]
        routing = dataclasses.replace(
            cfg.routing,
            num_experts=cfg.dspark_n_routed_experts,
            top_k=cfg.dspark_num_experts_per_tok,
            normalize=cfg.norm_topk_prob and cfg.dspark_num_experts_per_tok > 1,
        )
        self.stages = []
        for i in range(cfg.num_nextn_predict_layers):
            p = f"model.mtp.{i}"
            mixers = [tuple(w[f"{p}.hc_{site}_{n}"] for n in ("fn", "scale", "base")) for site in ("attn", "ffn")]
            norms = (w[f"{p}.attn_norm.weight"], w[f"{p}.ffn_norm.weight"])
            attention = V41Attention(backend, cfg, w, f"{p}.attn", _WINDOW_ONLY, ropes, None)
            self.stages.append((mixers, norms, attention, v41_moe(backend, cfg, w, f"{p}.ffn", routing)))
        last = f"model.mtp.{cfg.num_nextn_predict_layers - 1}"
        self.norm = w[f"{last}.norm.weight"]
        self.markov_embed, self.markov_head = (w[f"{last}.markov_head.{n}.weight"] for n in ("embed", "head"))
        self.confidence = w[f"{last}.confidence_head.proj.weight"].float()  # [1, D + rank], applied in float32
        self.cache_specs = [{"window": attention.window_spec} for _, _, attention, _ in self.stages]

    def target_forward(self, model, token_ids, positions, meta: AttentionMetadata, caches):
        """The backbone's step -> (final hidden states [T, D], the taps [T, targets x D] this drafter reads)."""
        hidden = model.forward(token_ids, positions, meta, caches)
        return hidden, model.taps

    def forward(self, next_ids, positions: torch.Tensor, taps: torch.Tensor, meta: AttentionMetadata, caches) -> None:
        """Catch up over a step's positions (next_ids unused): each stage's ring gets its entries of the
        context vectors of the backbone's `taps` [T, targets x D]; writes the rings only."""
        context = self.ops.rms_norm(self.ops.linear(taps, self.main_proj), self.main_norm, self.eps)  # [T, D]
        step = V4Step(meta, positions, self.block_size)
        for (_, _, attention, _), cache in zip(self.stages, caches):
            slots, rows = step.ring_writes(attention.window_spec.ring_size)
            entries = attention.window_entries(context[rows], positions[rows])
            self.layout.write(cache["window"], attention.window_spec, slots, entries)

    def block(
        self, anchors: torch.Tensor, anchor_positions: torch.Tensor, meta: AttentionMetadata, caches, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """anchors, anchor_positions [R]; meta: the requests' blocks (k rows each, seq_lens = position + k)
        -> (the rows' hidden states before the final norm [R * k, D], row token ids [R * k])."""
        ops, cfg, eps = self.ops, self.config, self.eps
        ids = torch.full((anchors.shape[0], k), cfg.dspark_noise_token_id, dtype=torch.int64, device=anchors.device)
        ids[:, 0] = anchors
        ids = ids.flatten()
        positions = (anchor_positions[:, None] + torch.arange(k, device=anchors.device)).flatten()
        positions = positions.clamp(max=cfg.max_position_embeddings - 1)  # past the model's length: drafts unused
        streams = self.model.embed[ids][:, None, :].expand(-1, cfg.hc_mult, -1).contiguous()  # [R k, N, D]
        pre = torch.zeros(streams.shape[:2], dtype=torch.float32, device=streams.device)
        pre[:, 0] = 1.0  # the first attention input is the embedding, as in the backbone
        for (mixers, (attn_norm, ffn_norm), attention, moe), cache in zip(self.stages, caches):
            attn_pre, post, comb = hc_mixes(ops, cfg, streams, mixers[0])
            x = ops.rms_norm(ops.hc_collapse(streams, pre), attn_norm, eps)
            q, _ = attention.queries(x, positions)
            kv = attention.window_entries(x, positions)[:, 0]
            out = self.attention.block_attention(
                q, kv, cache["window"], attention.window_spec, meta, sinks=attention.sinks, scale=cfg.head_dim**-0.5
            )
            streams = ops.hc_expand(attention.output(out, positions), streams, post, comb)
            pre, post, comb = hc_mixes(ops, cfg, streams, mixers[1])
            x = ops.rms_norm(ops.hc_collapse(streams, attn_pre), ffn_norm, eps)
            streams = ops.hc_expand(moe(x, ids), streams, post, comb)
        return ops.hc_collapse(streams, pre), ids

    def heads(self, hidden: torch.Tensor, anchors: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's hidden states [R * k, D] -> (greedy drafts [R, k], confidences [R, k] float32)."""
        base = self.model.logits(self.ops.rms_norm(hidden, self.norm, self.eps)).view(-1, k, self.config.vocab_size)
        hidden = hidden.view(-1, k, hidden.shape[-1]).float()
        previous, drafts, confidences = anchors, [], []
        for j in range(k):
            embedded = self.markov_embed[previous]  # [R, rank]
            logits = base[:, j] + self.ops.linear(embedded, self.markov_head).float()
            features = torch.cat([hidden[:, j], embedded.float()], dim=-1)  # [R, D + rank]
            confidences.append(torch.sigmoid(features @ self.confidence.T)[:, 0])
            previous = logits.argmax(dim=-1)
            drafts.append(previous)
        return torch.stack(drafts, dim=1), torch.stack(confidences, dim=1)

    def draft(self, step, caches, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Catch up over the step's positions, then draft k tokens per sampled request from the token after
        its last accepted position -> (drafts [R, k] int64, confidences [R, k] float32)."""
        self.forward(step.next_ids, step.positions, step.hidden, step.meta, caches)
        last = step.last_token_index[step.first_row + step.accepted]  # [R] the last accepted row, in [T]
        anchors, anchor_positions = step.next_ids[last], step.positions[last] + 1
        seqs, meta = step.seq_index, step.meta
        blocks = AttentionMetadata(
            query_start_loc=torch.arange(len(last) + 1, device=last.device) * k,
            seq_lens=anchor_positions + k,
            block_tables=meta.block_tables[seqs],
            slot_mapping=torch.zeros(len(last) * k, dtype=torch.int64, device=last.device),  # nothing is written
            max_query_len=k,
            seq_slots=meta.seq_slots[seqs],
            window_starts=meta.window_starts[seqs],
            cached_lens=meta.cached_lens[seqs],
        )
        hidden, _ = self.block(anchors, anchor_positions, blocks, caches, k)
        return self.heads(hidden, anchors, k)


def load_dspark(path: Path, raw: dict[str, Any], model, backend: ResolvedBackend, progress: bool) -> DSparkDrafter:
    """The DSpark layers of the DeepSeek-V4.1 checkpoint at `path` (config.json `raw`) for `model`."""
    cfg: DeepseekV41Config = model.config
    if cfg.num_nextn_predict_layers < 1:
        raise CheckpointError(
            f"{path}/config.json has num_nextn_predict_layers = {cfg.num_nextn_predict_layers}: the checkpoint has "
            'no DSpark layers to draft with; use {"method": "ngram"}'
        )
    if not 0 <= cfg.dspark_noise_token_id < cfg.vocab_size:
        raise CheckpointError(
            f"{path}/config.json: dspark_noise_token_id {cfg.dspark_noise_token_id} is not a token id (vocab_size "
            f"{cfg.vocab_size}); the draft block's fillers are that token"
        )
    if (reason := backend.capabilities.supports("block_attention")) is not True:
        raise UnsupportedModelError(
            f"backend {backend.info.name} cannot draft with DSpark: it lacks block_attention ({reason}); "
            'use {"method": "ngram"} or the cpu backend'
        )
    keep = kept_formats(backend.capabilities.weight_formats, QUANTIZED_WEIGHTS_V4)
    weights = load_tensors(
        path, raw, dspark_weight_shapes(cfg), backend.dtype, FLOAT32_WEIGHTS_V41, progress, keep, v41_spellings(cfg)
    )
    return DSparkDrafter(model, weights, backend)
