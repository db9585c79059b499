"""DeepSeek-V4 attention written against the backend contract: sliding window, CSA and HCA.

Every layer attends a sliding window of its own K = V entries (one shared head of head_dim). Compressed
layers add a compressor that pools each window of `rate` tokens into one entry (HCA: rate 128, every
entry attended; CSA: rate 4 with overlapping windows, a lightning indexer choosing the top-k entries).

What each layer caches (names in `cache_specs`):
  window            SLIDING_WINDOW ring of the K = V entries (window + rollback slots)
  compressed        PAGED compressed entries, block_size / rate per block          (CSA, HCA)
  compressor_state  SEQUENCE_STATE: kv | gate projections of the last 1 (HCA) or 2 (CSA) windows' tokens
                    and ROLLBACK_SLOTS more
  index_keys        PAGED indexer keys, one per compressed entry                     (CSA)
  index_state       SEQUENCE_STATE: the indexer compressor's projections              (CSA)
Shapes: T tokens in the step, H heads, Dh head_dim, R rope dims, E entries completed in the step.
"""

from __future__ import annotations

import torch

from deepinfer_core.backend.resolve import ResolvedBackend
from deepinfer_core.kv.layout import CacheKind, CacheSpec
from deepinfer_core.model.config_v4 import CSA, SLIDING, DeepseekV4Config
from deepinfer_core.model.v4_step import V4Step

__all__ = ["V4Attention", "ROLLBACK_SLOTS"]

Weights = dict[str, torch.Tensor]
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [max_positions, R/2]
# Ring slots past the window, and state rows past a compressor's span (production V4.1 Flash: 6): a verify
# step of up to this many drafted tokens writes the rejected ones where no later step reads, so nothing
# has to be put back (speculative decoding).
ROLLBACK_SLOTS = 6


def rope_tail(ops, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last R dims of x [N, H, Dh] (interleaved pairs), R = 2 * cos.shape[1]."""
    rope_dims = 2 * cos.shape[1]
    rotated = ops.rotary(x[..., -rope_dims:], positions, cos, sin, interleaved=True)
    return torch.cat([x[..., :-rope_dims], rotated], dim=-1)


class Compressor:
    """Pools each finished window of `rate` tokens into one normalised, roped entry (paper §2.3).

    Projections kv, gate [T, width] (width = head_dim, or 2 x head_dim split Ca | Cb when `overlap`).
    Entry w = norm(sum_slots softmax_slots(gate + ape) * kv) over its window's tokens (HCA), or over
    window w - 1's Ca and window w's Cb (CSA: width 2 x rate, stride rate), roped at position w * rate.
    """

    def __init__(
        self,
        backend: ResolvedBackend,
        w: Weights,
        prefix: str,
        rate: int,
        head_dim: int,
        overlap: bool,
        rope: Rope,
        eps: float,
    ) -> None:
        self.ops, self.layout = backend.ops, backend.kv_layout
        self.rate, self.head_dim, self.overlap, self.rope, self.eps = rate, head_dim, overlap, rope, eps
        self.w_kv_gate = torch.cat([w[f"{prefix}.wkv.weight"], w[f"{prefix}.wgate.weight"]])  # [2 * width, D]
        self.ape = w[f"{prefix}.ape"].float()  # [rate, width]
        self.norm = w[f"{prefix}.norm.weight"]
        self.width = self.ape.shape[1]
        self.entry_spec = CacheSpec(CacheKind.PAGED, backend.dtype, 1, head_dim, compress_rate=rate)
        self.rows = (2 * rate if overlap else rate) + ROLLBACK_SLOTS
        self.state_spec = CacheSpec(CacheKind.SEQUENCE_STATE, torch.float32, state_shape=(self.rows, 2 * self.width))

    def __call__(self, x: torch.Tensor, step: V4Step, entries: torch.Tensor, state: torch.Tensor) -> None:
        """Write the entries of the windows this step finishes, and the projections later ones need."""
        plan = step.compress_plan(self.rate, self.overlap, self.rows)
        projected = self.ops.linear(x, self.w_kv_gate).float()  # [T, 2 * width]
        states = self.layout.gather(state, self.state_spec, step.seq_slots)  # [B, S, 2 * width]
        if plan.num_entries:
            table = torch.cat([states.flatten(0, 1), projected])  # state rows, then this step's
            rows = table[plan.sources]  # [E, span, 2 * width]
            kv, gate = rows[..., : self.width], rows[..., self.width :]
            if self.overlap:  # slots 0..rate-1: window w-1's Ca; rate..2 rate-1: window w's Cb
                d, r = self.head_dim, self.rate
                kv = torch.cat([kv[:, :r, :d], kv[:, r:, d:]], dim=1)  # [E, 2 rate, Dh]
                gate = torch.cat([gate[:, :r, :d] + self.ape[:, :d], gate[:, r:, d:] + self.ape[:, d:]], dim=1)
            else:
                gate = gate + self.ape
            gate = gate.masked_fill(~plan.valid[:, :, None], float("-inf"))
            pooled = self.ops.softmax_pool(kv.to(x.dtype), gate)  # [E, Dh]
            entry = rope_tail(
                self.ops, self.ops.rms_norm(pooled, self.norm, self.eps)[:, None, :], plan.positions, *self.rope
            )
            if plan.written is not None:  # entries sharing a slot all write the same one
                entry = entry[plan.written]
            self.layout.write(entries, self.entry_spec, plan.slots, entry)
        states[plan.state_seqs, plan.state_rows] = projected[plan.state_tokens]
        self.layout.write(state, self.state_spec, step.seq_slots, states)


class V4Attention:
    """One V4 attention layer (any of the three types) over the caches named in `cache_specs`."""

    def __init__(
        self, backend: ResolvedBackend, cfg: DeepseekV4Config, w: Weights, prefix: str, layer: int, ropes: dict
    ) -> None:
        self.ops, self.attention, self.layout = backend.ops, backend.attention, backend.kv_layout
        self.cfg, self.kind, self.eps = cfg, cfg.layer_types[layer], cfg.rms_norm_eps
        heads, dh = cfg.num_attention_heads, cfg.head_dim
        self.rope = ropes["main" if self.kind == SLIDING else "compress"]
        self.unrope = (self.rope[0], -self.rope[1])  # rotation by -position: undoes the values' rope
        self.wq_a, self.q_norm = w[f"{prefix}.wq_a.weight"], w[f"{prefix}.q_norm.weight"]
        self.wq_b, self.wkv, self.kv_norm = (
            w[f"{prefix}.wq_b.weight"],
            w[f"{prefix}.wkv.weight"],
            w[f"{prefix}.norm.weight"],
        )
        self.head_norm = torch.ones(dh, dtype=backend.dtype, device=backend.torch_device)  # q's unweighted norm
        self.wo_a = w[f"{prefix}.wo_a.weight"].view(cfg.o_groups, cfg.o_lora_rank, heads * dh // cfg.o_groups)
        self.wo_b, self.sinks = w[f"{prefix}.wo_b.weight"], w[f"{prefix}.attn_sink"].float()
        self.window_spec = CacheSpec(
            CacheKind.SLIDING_WINDOW, backend.dtype, 1, dh, window=cfg.sliding_window, rollback_slots=ROLLBACK_SLOTS
        )
        self.cache_specs = {"window": self.window_spec}
        self.compressor = self.indexer = None
        if self.kind != SLIDING:
            rate = cfg.rate(layer)
            self.compressor = Compressor(
                backend, w, f"{prefix}.compressor", rate, dh, self.kind == CSA, ropes["compress"], self.eps
            )
            self.cache_specs |= {
                "compressed": self.compressor.entry_spec,
                "compressor_state": self.compressor.state_spec,
            }
        if self.kind == CSA:
            self.indexer = Compressor(
                backend, w, f"{prefix}.indexer.compressor", rate, cfg.index_head_dim, True, ropes["compress"], self.eps
            )
            self.index_wq_b = w[f"{prefix}.indexer.wq_b.weight"]  # [Hi * Di, q_lora]
            self.index_weights = w[f"{prefix}.indexer.weights_proj.weight"]  # [Hi, D]
            self.cache_specs |= {"index_keys": self.indexer.entry_spec, "index_state": self.indexer.state_spec}

    def _indices(self, x: torch.Tensor, q_latent: torch.Tensor, step: V4Step, caches: dict) -> torch.Tensor:
        """The lightning indexer's top-k compressed entries per query [T, index_topk] (-1: none)."""
        cfg = self.cfg
        self.indexer(x, step, caches["index_keys"], caches["index_state"])
        q = self.ops.linear(q_latent, self.index_wq_b).view(x.shape[0], cfg.index_n_heads, cfg.index_head_dim)
        q = rope_tail(self.ops, q, step.positions, *self.rope)
        weights = self.ops.linear(x, self.index_weights).float() * cfg.index_n_heads**-0.5  # [T, Hi]
        return self.attention.indexer_topk(
            q,
            weights,
            caches["index_keys"],
            self.indexer.entry_spec,
            step.meta,
            top_k=cfg.index_topk,
            scale=cfg.index_head_dim**-0.5,
        )

    def __call__(self, x: torch.Tensor, step: V4Step, caches: dict[str, torch.Tensor]) -> torch.Tensor:
        """x [T, D] (normalised) -> [T, D]; reads and writes this layer's caches."""
        ops, cfg, tokens = self.ops, self.cfg, x.shape[0]
        q_latent = ops.rms_norm(ops.linear(x, self.wq_a), self.q_norm, self.eps)  # [T, q_lora]
        q = ops.linear(q_latent, self.wq_b).view(tokens * cfg.num_attention_heads, cfg.head_dim)
        q = ops.rms_norm(q, self.head_norm, self.eps).view(tokens, cfg.num_attention_heads, cfg.head_dim)
        q = rope_tail(ops, q, step.positions, *self.rope)  # [T, H, Dh]
        kv = ops.rms_norm(ops.linear(x, self.wkv), self.kv_norm, self.eps)[:, None, :]
        kv = rope_tail(ops, kv, step.positions, *self.rope)  # [T, 1, Dh]
        compressed = indices = None
        if self.compressor is not None:
            self.compressor(x, step, caches["compressed"], caches["compressor_state"])
            compressed = caches["compressed"]
        if self.indexer is not None:
            indices = self._indices(x, q_latent, step, caches)
        out = self.attention.sparse_attention(
            q,
            kv[:, 0],
            caches["window"],
            self.window_spec,
            step.meta,
            sinks=self.sinks,
            scale=cfg.head_dim**-0.5,
            compressed=compressed,
            compressed_spec=None if compressed is None else self.compressor.entry_spec,
            indices=indices,
        )  # [T, H, Dh]
        slots, rows = step.ring_writes(self.window_spec.ring_size)
        self.layout.write(caches["window"], self.window_spec, slots, kv[rows])
        out = rope_tail(ops, out, step.positions, *self.unrope)
        grouped = ops.head_linear(out.reshape(tokens, cfg.o_groups, -1), self.wo_a)  # [T, G, o_lora]
        return ops.linear(grouped.reshape(tokens, -1), self.wo_b)
