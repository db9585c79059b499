"""Reference paged attention: one sequence at a time, gather the context, softmax in float32."""

from __future__ import annotations

import torch

from deepinfer_core.backend.ops import AttentionMetadata
from deepinfer_core.kv.layout import CacheSpec, KVLayout, compressed_slots, paged_slots, ring_slots

__all__ = ["ReferenceAttention"]


class ReferenceAttention:
    """Implements AttentionOps over any KVLayout by reading the canonical view through `gather`."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout

    def paged_attention(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        spec: CacheSpec,
        meta: AttentionMetadata,
        *,
        scale: float,
        value_dim: int,
        value_offset: int = 0,
    ) -> torch.Tensor:
        num_heads, key_dim = q.shape[1], q.shape[2]
        group = num_heads // spec.num_heads  # query heads per cached head
        out = q.new_empty((q.shape[0], num_heads, value_dim))
        starts = meta.query_start_loc.tolist()
        for b, seq_len in enumerate(meta.seq_lens.tolist()):
            q_start, q_end = starts[b], starts[b + 1]
            if q_end == q_start:
                continue
            positions = torch.arange(seq_len, device=q.device)
            slots = paged_slots(meta.block_tables[b], positions, self.layout.block_size)
            entries = self.layout.gather(cache, spec, slots).float()  # [S, Hkv, Dc]
            keys = entries[..., :key_dim]
            values = entries[..., value_offset : value_offset + value_dim]
            queries = q[q_start:q_end].float().unflatten(1, (spec.num_heads, group))  # [Q, Hkv, G, Dk]
            scores = torch.einsum("qkgd,skd->kgqs", queries, keys) * scale  # [Hkv, G, Q, S]
            q_pos = torch.arange(seq_len - (q_end - q_start), seq_len, device=q.device)  # [Q]
            scores = scores.masked_fill(positions[None, :] > q_pos[:, None], float("-inf"))
            attended = torch.einsum("kgqs,skd->qkgd", scores.softmax(dim=-1), values)  # [Q, Hkv, G, Dv]
            out[q_start:q_end] = attended.flatten(1, 2).to(q.dtype)
        return out

    def _compressed_entries(
        self, cache: torch.Tensor, spec: CacheSpec, meta: AttentionMetadata, b: int, count: int
    ) -> torch.Tensor:
        """The first `count` compressed entries of sequence b: [count, D] float32."""
        entries = torch.arange(count, device=cache.device)
        slots = compressed_slots(meta.block_tables[b], entries, self.layout.block_size, spec.compress_rate)
        return self.layout.gather(cache, spec, slots)[:, 0].float()

    def _window(
        self, kv: torch.Tensor, ring: torch.Tensor, spec: CacheSpec, rows: range, first: int, since: int, seq_slot: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's window keys: its ring entries of positions since .. first - 1, then this step's
        (token `rows`, from position `first`); (keys [S, D] float32, positions [S])."""
        earlier = torch.arange(since, first, device=kv.device)
        slots = ring_slots(seq_slot, earlier, spec.ring_size)
        keys = torch.cat([self.layout.gather(ring, spec, slots)[:, 0].float(), kv[rows.start : rows.stop].float()])
        return keys, torch.arange(since, first + len(rows), device=kv.device)

    def sparse_attention(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        ring: torch.Tensor,
        ring_spec: CacheSpec,
        meta: AttentionMetadata,
        *,
        sinks: torch.Tensor,
        scale: float,
        compressed: torch.Tensor | None = None,
        compressed_spec: CacheSpec | None = None,
        indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        starts = meta.query_start_loc.tolist()  # host copies, once per call (not per sequence)
        window_starts, seq_slots = meta.window_starts.tolist(), meta.seq_slots.tolist()
        for b, seq_len in enumerate(meta.seq_lens.tolist()):
            q_start, q_end = starts[b], starts[b + 1]
            if q_end == q_start:
                continue
            first = seq_len - (q_end - q_start)  # position of the step's first query
            since = max(first - (ring_spec.window - 1), window_starts[b])  # a query sees window - 1 earlier
            q_pos = torch.arange(first, seq_len, device=q.device)  # [Q]
            keys, k_pos = self._window(kv, ring, ring_spec, range(q_start, q_end), first, since, seq_slots[b])
            hidden = (k_pos[None, :] > q_pos[:, None]) | (k_pos[None, :] <= q_pos[:, None] - ring_spec.window)
            mask = torch.where(hidden, float("-inf"), 0.0)  # [Q, S]
            if compressed is not None:
                rate = compressed_spec.compress_rate
                entries = self._compressed_entries(compressed, compressed_spec, meta, b, seq_len // rate)  # [C, D]
                visible = torch.arange(entries.shape[0], device=q.device)[None, :] < ((q_pos + 1) // rate)[:, None]
                if indices is not None:
                    chosen = torch.zeros_like(visible)
                    picks = indices[q_start:q_end]  # [Q, K]
                    rows = torch.arange(q_end - q_start, device=q.device)[:, None].expand_as(picks)
                    listed = (picks >= 0) & (picks < entries.shape[0])  # -1 and entries past the end: none
                    chosen[rows[listed], picks[listed]] = True
                    visible &= chosen
                keys = torch.cat([keys, entries])
                mask = torch.cat([mask, torch.where(visible, 0.0, float("-inf"))], dim=1)
            logits = torch.einsum("qhd,sd->hqs", q[q_start:q_end].float(), keys) * scale + mask  # [H, Q, S]
            sink = sinks.float()[:, None, None].expand(-1, q_end - q_start, 1)
            probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
            out[q_start:q_end] = torch.einsum("hqs,sd->qhd", probs, keys).to(q.dtype)
        return out

    def indexer_topk(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        keys_spec: CacheSpec,
        meta: AttentionMetadata,
        *,
        top_k: int,
        scale: float,
    ) -> torch.Tensor:
        out = torch.full((q.shape[0], top_k), -1, dtype=torch.int64, device=q.device)
        starts = meta.query_start_loc.tolist()
        rate = keys_spec.compress_rate
        for b, seq_len in enumerate(meta.seq_lens.tolist()):
            q_start, q_end = starts[b], starts[b + 1]
            count = seq_len // rate
            if q_end == q_start or count == 0:
                continue
            q_pos = torch.arange(seq_len - (q_end - q_start), seq_len, device=q.device)
            entries = self._compressed_entries(keys, keys_spec, meta, b, count)  # [C, Di]
            scores = torch.relu(torch.einsum("qhd,cd->qhc", q[q_start:q_end].float(), entries)) * scale
            scores = (scores * weights[q_start:q_end].float()[:, :, None]).sum(dim=1)  # [Q, C]
            visible = torch.arange(count, device=q.device)[None, :] < ((q_pos + 1) // rate)[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
            k = min(top_k, count)
            picks = scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]  # ties: lower entry first
            picks = torch.where(picks < ((q_pos + 1) // rate)[:, None], picks, -1)
            out[q_start:q_end, :k] = picks
        return out
