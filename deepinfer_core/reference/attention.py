"""Reference paged attention: one sequence at a time, gather the context, softmax in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer_core.backend.ops import AttentionMetadata
from deepinfer_core.kv.layout import CacheSpec, KVLayout, compressed_slots, paged_slots, ring_slots

__all__ = ["ReferenceAttention"]


def _best_first(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[Q, N] -> the k best column numbers of each row, best first; ties to the lower number (stable sort)."""
    return scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]


def _best_blocks(scores: torch.Tensor, visible: torch.Tensor, block_size: int, top_blocks: int) -> torch.Tensor:
    """scores [Q, C] (-inf where not visible), visible [Q] -> [Q, top_blocks]: the blocks of `block_size`
    entries with the best max score, the newest visible entry's block first, none without a visible entry,
    then -1."""
    queries, count = scores.shape
    num_blocks = -(-count // block_size)
    padded = F.pad(scores, (0, num_blocks * block_size - count), value=float("-inf"))
    block_scores = padded.view(queries, num_blocks, block_size).amax(dim=-1)  # [Q, NB]
    seen = visible > 0
    block_scores[seen, (visible[seen] - 1) // block_size] = float("inf")  # the newest visible entry's block
    k = min(top_blocks, num_blocks)
    picks = _best_first(block_scores, k)  # [Q, k]
    out = torch.full((queries, top_blocks), -1, dtype=torch.int64, device=scores.device)
    out[:, :k] = torch.where(block_scores.gather(1, picks) > float("-inf"), picks, -1)
    return out


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

    def block_attention(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        ring: torch.Tensor,
        ring_spec: CacheSpec,
        meta: AttentionMetadata,
        *,
        sinks: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        starts = meta.query_start_loc.tolist()
        window_starts, seq_slots = meta.window_starts.tolist(), meta.seq_slots.tolist()
        for b, seq_len in enumerate(meta.seq_lens.tolist()):
            q_start, q_end = starts[b], starts[b + 1]
            if q_end == q_start:
                continue
            first = seq_len - (q_end - q_start)  # the block's first position
            since = max(first - ring_spec.window, window_starts[b], 0)
            keys, _ = self._window(kv, ring, ring_spec, range(q_start, q_end), first, since, seq_slots[b])  # all seen
            logits = torch.einsum("qhd,sd->hqs", q[q_start:q_end].float(), keys) * scale  # [H, Q, S]
            sink = sinks.float()[:, None, None].expand(-1, q_end - q_start, 1)
            probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
            out[q_start:q_end] = torch.einsum("hqs,sd->qhd", probs, keys).to(q.dtype)
        return out

    def _index_scores(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        spec: CacheSpec,
        meta: AttentionMetadata,
        b: int,
        seq_len: int,
        queries: range,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer scores of sequence b's step queries (token rows `queries`) over its entries, -inf where
        a query cannot see one yet: (scores [Q, C] float32, visible entries per query [Q])."""
        rate = spec.compress_rate
        count = seq_len // rate
        q_pos = torch.arange(seq_len - len(queries), seq_len, device=q.device)  # [Q]
        visible = (q_pos + 1) // rate  # [Q]
        entries = self._compressed_entries(keys, spec, meta, b, count)  # [C, Di]
        rows = slice(queries.start, queries.stop)
        scores = torch.relu(torch.einsum("qhd,cd->qhc", q[rows].float(), entries)) * scale  # [Q, Hi, C]
        scores = (scores * weights[rows].float()[:, :, None]).sum(dim=1)  # [Q, C]
        hidden = torch.arange(count, device=q.device)[None, :] >= visible[:, None]
        return scores.masked_fill(hidden, float("-inf")), visible

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
        for b, seq_len in enumerate(meta.seq_lens.tolist()):
            q_start, q_end = starts[b], starts[b + 1]
            count = seq_len // keys_spec.compress_rate
            if q_end == q_start or count == 0:
                continue
            queries = range(q_start, q_end)
            scores, visible = self._index_scores(q, weights, keys, keys_spec, meta, b, seq_len, queries, scale)
            k = min(top_k, count)
            picks = _best_first(scores, k)  # ties: lower entry first
            out[q_start:q_end, :k] = torch.where(picks < visible[:, None], picks, -1)
        return out

    def indexer_select(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        keys_spec: CacheSpec,
        meta: AttentionMetadata,
        *,
        top_k: int,
        scale: float,
        within: torch.Tensor | None = None,
        block_size: int = 1,
        top_blocks: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        tokens = q.shape[0]
        indices = torch.full((tokens, top_k), -1, dtype=torch.int64, device=q.device)
        blocks = torch.full((tokens, top_blocks), -1, dtype=torch.int64, device=q.device) if top_blocks else None
        starts = meta.query_start_loc.tolist()
        for b, seq_len in enumerate(meta.seq_lens.tolist()):
            q_start, q_end = starts[b], starts[b + 1]
            count = seq_len // keys_spec.compress_rate
            if q_end == q_start or count == 0:
                continue
            queries = range(q_start, q_end)
            scores, visible = self._index_scores(q, weights, keys, keys_spec, meta, b, seq_len, queries, scale)
            if blocks is not None:  # from every visible entry, whatever `within` lists
                blocks[q_start:q_end] = _best_blocks(scores, visible, block_size, top_blocks)
            if within is not None:
                entry_blocks = torch.arange(count, device=q.device) // block_size  # [C]
                listed = (entry_blocks[None, :, None] == within[q_start:q_end, None, :]).any(dim=-1)  # [Q, C]
                scores = scores.masked_fill(~listed, float("-inf"))
            k = min(top_k, count)
            picks = _best_first(scores, k)  # [Q, k], ties: lower entry first
            indices[q_start:q_end, :k] = torch.where(scores.gather(1, picks) > float("-inf"), picks, -1)
        return indices, blocks
