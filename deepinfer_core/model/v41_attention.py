"""DeepSeek-V4.1 attention written against the backend contract: a sliding window on every layer, plus
compressed KV shared by the layers of a group (CSA2) and chosen by an indexer (docs/deepseek_v41_reference.md §3).

Each group starts at a KV source, which pools every `ratio` tokens into one entry (ratio 1: one entry per
token, the CED decoder) and, being an index source too, projects the group's indexer keys. Index sources
publish a top-k of entries for this step's queries; the layers after them reuse it. The candidate source
also publishes each query's best entry blocks, which restrict every later index source ("reindex").

What a layer caches (names in `cache_specs`; the group's caches live on its KV source only; each KV cache's
spec names the format its values are rounded to, `stored_format`, so a layout may store it packed):
  window            SLIDING_WINDOW ring of the K = V entries, FP8-rounded            (every layer)
  compressed        PAGED entries, block_size / ratio per block, FP4-rounded          (KV sources)
  index_keys        PAGED indexer keys, one per compressed entry, FP4-rounded        (KV sources)
  compressor_state  SEQUENCE_STATE: kv | gate projections of a partial group (fp32)  (KV sources, ratio > 1)
                    and of ROLLBACK_SLOTS tokens more (a verify step's rejected drafts)
Shapes: T tokens in the step, H heads, Dh head_dim, Hi / Di index heads / dims, E entries finished in the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_core.backend.resolve import ResolvedBackend
from deepinfer_core.kv.layout import CacheKind, CacheSpec
from deepinfer_core.model.config_v41 import DeepseekV41Config, LayerPlan
from deepinfer_core.model.v4_attention import ROLLBACK_SLOTS, rope_tail
from deepinfer_core.model.v4_step import V4Step

__all__ = ["SharedIndices", "V41Attention"]

Weights = dict[str, torch.Tensor]
WINDOW_FORMAT = ("fp8_e4m3/pow2:32", 32)  # the window KV as the reference rounds it (format, block)
ENTRY_FORMAT = ("fp4_e2m1/e4m3:16", 16)  # compressed entries
INDEX_FORMAT = ("fp4_e2m1/pow2:32", 32)  # indexer keys and queries


def _rounded(ops, x: torch.Tensor, fmt: tuple[str, int]) -> torch.Tensor:
    """x as stored in `fmt`; the reference leaves vectors whose size the block does not divide as they are."""
    name, block = fmt
    return ops.round_to_format(x, name) if x.shape[-1] % block == 0 else x


def _stored(fmt: tuple[str, int], dim: int) -> str:
    """A cache's stored_format: what `_rounded` rounds its `dim`-vectors to, or "" where it leaves them."""
    name, block = fmt
    return name if dim % block == 0 else ""


@dataclass
class SharedIndices:
    """What index sources publish for the layers after them, within one step."""

    indices: torch.Tensor | None = None  # [T, index_topk] entries of the group (-1: none)
    blocks: torch.Tensor | None = None  # [T, candidate_topk_blocks] the candidate source's blocks (-1: none)

    def rows(self, keep: torch.Tensor) -> SharedIndices:
        """The same for the step's tokens `keep` [T'] (a narrower step's, v4_step.V4Step.suffix)."""
        return SharedIndices(*(None if t is None else t[keep] for t in (self.indices, self.blocks)))


class GroupCompressor:
    """A KV source's compressor: entries of `ratio` tokens (gated pooling in float32 when ratio > 1, the
    token's own projection when 1), normalised, roped at their first token, rounded, written to the group's
    cache; and, from the same unroped latents, the group's indexer keys."""

    def __init__(
        self, backend: ResolvedBackend, cfg: DeepseekV41Config, w: Weights, prefix: str, ratio: int, ropes: dict
    ) -> None:
        self.ops, self.layout, self.ratio, self.eps = backend.ops, backend.kv_layout, ratio, cfg.rms_norm_eps
        self.rope, dh = ropes["compress"], cfg.head_dim
        self.w_kv = w[f"{prefix}.compressor.wkv.weight"]  # [Dh, D]
        self.w_gate = w[f"{prefix}.compressor.wgate.weight"] if ratio > 1 else None
        self.norm = w[f"{prefix}.compressor.norm.weight"]
        self.entry_spec = CacheSpec(
            CacheKind.PAGED, backend.dtype, 1, dh, compress_rate=ratio, stored_format=_stored(ENTRY_FORMAT, dh)
        )
        self.state_spec, self.rows = None, 1  # ratio 1: no state; the plan's table has one unused row each
        if ratio > 1:
            self.w_kv_gate = torch.cat([self.w_kv, self.w_gate]).float()  # projected in float32
            self.rows = ratio + ROLLBACK_SLOTS
            self.state_spec = CacheSpec(CacheKind.SEQUENCE_STATE, torch.float32, state_shape=(self.rows, 2 * dh))
        self.w_keys = w[f"{prefix}.indexer.wk.weight"]  # [Di, Dh]
        self.key_norm = w[f"{prefix}.indexer.k_norm.weight"]
        di = cfg.index_head_dim
        self.key_spec = CacheSpec(
            CacheKind.PAGED, backend.dtype, 1, di, compress_rate=ratio, stored_format=_stored(INDEX_FORMAT, di)
        )

    def _latents(self, x: torch.Tensor, step: V4Step, caches: dict) -> tuple[torch.Tensor, object]:
        """The normalised, unroped latents [E, Dh] of the entries this step finishes, and the plan."""
        plan = step.compress_plan(self.ratio, False, self.rows)
        num_seqs = step.seq_slots.shape[0]
        if self.ratio == 1:  # the plan's table starts with one (unused) state row per sequence
            latents = self.ops.linear(x, self.w_kv)[plan.sources[:, 0] - num_seqs]
            return self.ops.rms_norm(latents, self.norm, self.eps), plan
        dh = self.w_kv.shape[0]
        state = caches["compressor_state"]
        projected = self.ops.linear(x.float(), self.w_kv_gate)  # [T, 2 Dh]
        states = self.layout.gather(state, self.state_spec, step.seq_slots)  # [B, rows, 2 Dh]
        latents = x.new_empty(0, dh)
        if plan.num_entries:
            rows = torch.cat([states.flatten(0, 1), projected])[plan.sources]  # [E, ratio, 2 Dh]
            pooled = self.ops.softmax_pool(rows[..., :dh], rows[..., dh:])  # [E, Dh] float32
            latents = self.ops.rms_norm(pooled.to(x.dtype), self.norm, self.eps)
        states[plan.state_seqs, plan.state_rows] = projected[plan.state_tokens]
        self.layout.write(state, self.state_spec, step.seq_slots, states)
        return latents, plan

    def __call__(self, x: torch.Tensor, step: V4Step, caches: dict) -> None:
        latents, plan = self._latents(x, step, caches)
        if not plan.num_entries:
            return
        if plan.written is not None:  # entries sharing a slot all write the same one
            latents = latents[plan.written]
        entries = rope_tail(self.ops, latents[:, None, :], plan.positions, *self.rope)
        self.layout.write(caches["compressed"], self.entry_spec, plan.slots, _rounded(self.ops, entries, ENTRY_FORMAT))
        keys = self.ops.rms_norm(self.ops.linear(latents, self.w_keys), self.key_norm, self.eps)[:, None, :]
        keys = rope_tail(self.ops, keys, plan.positions, *self.rope)
        self.layout.write(caches["index_keys"], self.key_spec, plan.slots, _rounded(self.ops, keys, INDEX_FORMAT))


class V41Attention:
    """One V4.1 attention layer, following its `LayerPlan`."""

    def __init__(
        self,
        backend: ResolvedBackend,
        cfg: DeepseekV41Config,
        w: Weights,
        prefix: str,
        plan: LayerPlan,
        ropes: dict,
        source: V41Attention | None,
    ) -> None:
        self.ops, self.attention, self.layout = backend.ops, backend.attention, backend.kv_layout
        self.cfg, self.plan, self.eps = cfg, plan, cfg.rms_norm_eps
        heads, dh = cfg.num_attention_heads, cfg.head_dim
        self.rope = ropes[plan.rope]
        self.unrope = (self.rope[0], -self.rope[1])  # rotation by -position: undoes the values' rope
        self.wq_a, self.q_norm = w[f"{prefix}.wq_a.weight"], w[f"{prefix}.q_norm.weight"]
        self.wq_b, self.wkv = w[f"{prefix}.wq_b.weight"], w[f"{prefix}.wkv.weight"]
        self.kv_norm = w[f"{prefix}.kv_norm.weight"]
        self.wo_a = w[f"{prefix}.wo_a.weight"].view(cfg.o_groups, cfg.o_lora_rank, heads * dh // cfg.o_groups)
        self.wo_b, self.sinks = w[f"{prefix}.wo_b.weight"], w[f"{prefix}.attn_sink"].float()
        self.window_spec = CacheSpec(
            CacheKind.SLIDING_WINDOW,
            backend.dtype,
            1,
            dh,
            window=cfg.sliding_window,
            rollback_slots=ROLLBACK_SLOTS,
            stored_format=_stored(WINDOW_FORMAT, dh),
        )
        self.cache_specs = {"window": self.window_spec}
        self.compressor = None
        if plan.is_kv_source:
            self.compressor = GroupCompressor(backend, cfg, w, prefix, plan.ratio, ropes)
            self.cache_specs |= {"compressed": self.compressor.entry_spec, "index_keys": self.compressor.key_spec}
            if self.compressor.state_spec is not None:
                self.cache_specs["compressor_state"] = self.compressor.state_spec
        # the group's compressor (this layer's own when it is the source)
        self.group = self.compressor if plan.is_kv_source else None if source is None else source.compressor
        if plan.is_index_source:
            self.index_wq_b = w[f"{prefix}.indexer.wq_b.weight"]  # [Hi * Di, q_lora]
            self.index_weights = w[f"{prefix}.indexer.weights_proj.weight"]  # [Hi, D]

    def _index(self, x, q_latent, step: V4Step, group_caches: dict, shared: SharedIndices) -> None:
        """Publish this index source's top-k (and, for the candidate source, its blocks) in `shared`."""
        cfg, plan = self.cfg, self.plan
        q = self.ops.linear(q_latent, self.index_wq_b).view(x.shape[0], cfg.index_n_heads, cfg.index_head_dim)
        q = _rounded(self.ops, rope_tail(self.ops, q, step.positions, *self.rope), INDEX_FORMAT)
        weights = self.ops.linear(x, self.index_weights).float() * cfg.index_n_heads**-0.5  # [T, Hi]
        indices, blocks = self.attention.indexer_select(
            q,
            weights,
            group_caches["index_keys"],
            self.group.key_spec,
            step.meta,
            top_k=cfg.index_topk,
            scale=cfg.index_head_dim**-0.5,
            within=shared.blocks if plan.uses_candidates else None,
            block_size=cfg.candidate_block_size,
            top_blocks=cfg.candidate_topk_blocks if plan.is_candidate_source else 0,
        )
        shared.indices = indices
        if plan.is_candidate_source:
            shared.blocks = blocks

    def queries(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] (normalised) -> (q [T, H, Dh] roped, the query latent [T, q_lora])."""
        ops, cfg = self.ops, self.cfg
        q_latent = ops.rms_norm(ops.linear(x, self.wq_a), self.q_norm, self.eps)  # [T, q_lora]
        q = ops.linear(q_latent, self.wq_b).view(x.shape[0], cfg.num_attention_heads, cfg.head_dim)
        return rope_tail(ops, q, positions, *self.rope), q_latent  # no per-head norm in V4.1

    def window_entries(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> the K = V window entries [T, 1, Dh]: normalised, roped, rounded as stored."""
        kv = self.ops.rms_norm(self.ops.linear(x, self.wkv), self.kv_norm, self.eps)[:, None, :]
        return _rounded(self.ops, rope_tail(self.ops, kv, positions, *self.rope), WINDOW_FORMAT)

    def output(self, out: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Attention's result [T, H, Dh] -> the layer's output [T, D]: values unroped, grouped projections."""
        tokens = out.shape[0]
        out = rope_tail(self.ops, out, positions, *self.unrope)
        grouped = self.ops.head_linear(out.reshape(tokens, self.cfg.o_groups, -1), self.wo_a)  # [T, G, o_lora]
        return self.ops.linear(grouped.reshape(tokens, -1), self.wo_b)

    def __call__(
        self, x: torch.Tensor, step: V4Step, caches: dict, group_caches: dict | None, shared: SharedIndices
    ) -> torch.Tensor:
        """x [T, D] (normalised) -> [T, D]; reads and writes this layer's caches and its group's."""
        cfg, plan = self.cfg, self.plan
        q, q_latent = self.queries(x, step.positions)
        kv = self.window_entries(x, step.positions)  # [T, 1, Dh]
        if plan.is_kv_source:
            self.compressor(x, step, caches)
        if plan.is_index_source:
            self._index(x, q_latent, step, group_caches, shared)
        attend = plan.ratio > 0 and plan.index_source is not None and shared.indices is not None
        out = self.attention.sparse_attention(
            q,
            kv[:, 0],
            caches["window"],
            self.window_spec,
            step.meta,
            sinks=self.sinks,
            scale=cfg.head_dim**-0.5,
            compressed=group_caches["compressed"] if attend else None,
            compressed_spec=self.group.entry_spec if attend else None,
            indices=shared.indices if attend else None,
        )  # [T, H, Dh]
        slots, rows = step.ring_writes(self.window_spec.ring_size)
        self.layout.write(caches["window"], self.window_spec, slots, kv[rows])
        return self.output(out, step.positions)
