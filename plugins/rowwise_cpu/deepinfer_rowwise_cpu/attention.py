"""Attention (deepinfer_core.backend.ops.AttentionOps, V4AttentionOps and V41AttentionOps) over HeadMajorKVLayout,
one query row at a time with an online (flash-style) softmax; imports only torch, deepinfer_core.backend and
deepinfer_core.kv.layout.

For each query row the entries it may see are visited in chunks, keeping a running max m, running sum l
and a rescaled accumulator in float32 (`_OnlineSoftmax`). paged_attention walks the sequence's blocks in
order; DeepSeek-V4's sparse_attention walks the sliding window (ring entries of earlier steps and this
step's entries, in position order), then the compressed entries block by block, then folds in the sink
logit; indexer_topk scores the visible compressed entries block by block, and DeepSeek-V4.1's indexer_select
ranks the same scores (optionally only the entries of listed blocks) and blocks of entries by their best
score, ties to the lower entry or block (stable sorts). A row's arithmetic depends only on its own position
and the cached entries, never on the other rows of the step: batch-invariant and chunk-invariant.
"""

from __future__ import annotations

import torch

from deepinfer_core.backend.ops import AttentionMetadata
from deepinfer_core.kv.layout import CacheKind, CacheSpec
from deepinfer_rowwise_cpu.kernels import fresh_row
from deepinfer_rowwise_cpu.kv import HeadMajorKVLayout

__all__ = ["OnlineSoftmaxAttention"]


def _query_rows(meta: AttentionMetadata):
    """Yield (token row t, its sequence's block table, its position) for every query of the step, sequence by
    sequence; the step's last query of a sequence sits at seq_len - 1."""
    starts = meta.query_start_loc.tolist()
    for b, seq_len in enumerate(meta.seq_lens.tolist()):
        q_start, q_end = starts[b], starts[b + 1]
        if q_end == q_start:
            continue  # no queries for this sequence in this step
        table = meta.block_tables[b].tolist()
        for t in range(q_start, q_end):
            yield t, table, seq_len - (q_end - t)


def _best(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The (up to) k best positions of scores [n], best first. A stable sort keeps equal scores in position
    order, so ties go to the lower position: the contract's tie rule, whatever the chunking."""
    return torch.sort(scores, descending=True, stable=True).indices[:k]


def _best_blocks(scores: torch.Tensor, block_size: int, top_blocks: int) -> torch.Tensor:
    """One query's entry scores [C] (C >= 1) -> up to top_blocks block ids: first the block of the newest
    entry C - 1 (always kept), then the other blocks by their best entry's score, ties to the lower block."""
    count = -(-scores.shape[0] // block_size)  # blocks with a visible entry; the last one is the newest's
    padded = torch.full((count * block_size,), float("-inf"), device=scores.device)
    padded[: scores.shape[0]] = scores
    block_scores = padded.view(count, block_size).amax(dim=1)  # [NB]: every block has one finite score
    newest = torch.tensor([count - 1], device=scores.device)
    return torch.cat([newest, _best(block_scores[: count - 1], top_blocks - 1)])


class _OnlineSoftmax:
    """softmax(scores) @ values accumulated chunk by chunk: for kv_heads cached heads, each shared by `group`
    query heads. m [Hkv, G, 1] running max, l [Hkv, G, 1] running sum of exp(s - m), acc [Hkv, G, Dv]
    running sum of exp(s - m) * v; all float32."""

    def __init__(self, kv_heads: int, group: int, value_dim: int, device: torch.device) -> None:
        self.run_max = torch.full((kv_heads, group, 1), float("-inf"), device=device)  # m
        self.run_sum = torch.zeros(kv_heads, group, 1, device=device)  # l
        self.acc = torch.zeros(kv_heads, group, value_dim, device=device)  # sum of exp(s - m) * v

    def add(self, scores: torch.Tensor, values: torch.Tensor) -> None:
        """Fold in one chunk: scores [Hkv, G, n] (finite, n >= 1) of values [Hkv, n, Dv]."""
        new_max = torch.maximum(self.run_max, scores.amax(dim=-1, keepdim=True))  # finite
        rescale = torch.exp(self.run_max - new_max)  # [Hkv, G, 1]; 0 on the first chunk
        weights = torch.exp(scores - new_max)  # [Hkv, G, n]
        self.run_sum = self.run_sum * rescale + weights.sum(dim=-1, keepdim=True)
        self.acc = self.acc * rescale + torch.bmm(weights, values)  # [Hkv, G, Dv]
        self.run_max = new_max

    def add_sink(self, sink: torch.Tensor) -> None:
        """Fold in a logit `sink` [Hkv, G, 1] whose value is zero: it only joins the normalisation."""
        new_max = torch.maximum(self.run_max, sink)
        rescale = torch.exp(self.run_max - new_max)
        self.run_sum = self.run_sum * rescale + torch.exp(sink - new_max)
        self.acc = self.acc * rescale
        self.run_max = new_max

    def result(self) -> torch.Tensor:
        """acc / l: [Hkv * G, Dv] float32."""
        return (self.acc / self.run_sum).flatten(0, 1)


class OnlineSoftmaxAttention:
    """Implements AttentionOps, V4AttentionOps and V41AttentionOps over HeadMajorKVLayout, one query row at a time."""

    def __init__(self, layout: HeadMajorKVLayout) -> None:
        if not isinstance(layout, HeadMajorKVLayout):
            raise TypeError(f"rowwise_cpu attention reads its own HeadMajorKVLayout, not {type(layout).__name__}")
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
        if spec.kind is not CacheKind.PAGED:
            raise ValueError(f"paged_attention reads a PAGED cache, not {spec.kind.value}")
        num_heads = q.shape[1]
        if num_heads % spec.num_heads:
            raise ValueError(f"{num_heads} query heads do not share {spec.num_heads} cached heads evenly")
        out = torch.zeros(q.shape[0], num_heads, value_dim, dtype=q.dtype, device=q.device)  # [T, H, Dv]
        starts = meta.query_start_loc.tolist()
        for b, seq_len in enumerate(meta.seq_lens.tolist()):
            q_start, q_end = starts[b], starts[b + 1]
            if q_end == q_start:
                continue  # no queries for this sequence in this step
            table = meta.block_tables[b].tolist()
            first_pos = seq_len - (q_end - q_start)  # absolute position of the sequence's first query
            for t in range(q_start, q_end):
                context = first_pos + (t - q_start) + 1  # causal: positions 0..pos
                out[t] = self._row(q[t], cache, spec, table, context, scale, value_dim, value_offset)
        return out

    def _row(
        self,
        q_row: torch.Tensor,
        cache: torch.Tensor,
        spec: CacheSpec,
        table: list[int],
        context: int,
        scale: float,
        value_dim: int,
        value_offset: int,
    ) -> torch.Tensor:
        """One query row q_row [H, Dk] over the first `context` cached tokens -> [H, value_dim] float32."""
        kv_heads, key_dim = spec.num_heads, q_row.shape[-1]
        group = q_row.shape[0] // kv_heads  # query heads per cached head (GQA; MLA has kv_heads 1)
        query = fresh_row(q_row).view(kv_heads, group, key_dim)  # [Hkv, G, Dk]
        state = _OnlineSoftmax(kv_heads, group, value_dim, query.device)
        block_size = self.layout.block_size
        for j in range(-(-context // block_size)):  # block 0 holds position 0: every chunk is non-empty
            valid = min(block_size, context - j * block_size)
            entries = self.layout.block(cache, table[j], valid).float()  # [Hkv, n, Dc]
            keys = entries[..., :key_dim]  # [Hkv, n, Dk]
            values = entries[..., value_offset : value_offset + value_dim]  # [Hkv, n, Dv]
            state.add(torch.bmm(query, keys.transpose(1, 2)) * scale, values)  # scores [Hkv, G, n]
        return state.result()

    # ------------------------------------------------------------------ DeepSeek-V4 (V4AttentionOps)

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
        if ring_spec.kind is not CacheKind.SLIDING_WINDOW:
            raise ValueError(f"sparse_attention's window is a SLIDING_WINDOW cache, not {ring_spec.kind.value}")
        if compressed is not None and (compressed_spec is None or compressed_spec.kind is not CacheKind.PAGED):
            raise ValueError("sparse_attention's compressed entries are a PAGED cache with its compressed_spec")
        out = torch.empty_like(q)  # [T, H, D]
        sink = sinks.float().view(1, -1, 1)  # [1, H, 1]: one shared K = V head, H query heads
        starts = meta.query_start_loc.tolist()
        for b, seq_len in enumerate(meta.seq_lens.tolist()):
            q_start, q_end = starts[b], starts[b + 1]
            if q_end == q_start:
                continue
            first = seq_len - (q_end - q_start)  # position of the step's first query
            since = int(meta.window_starts[b])  # ring entries before it are stale
            window = self.layout.ring(ring, int(meta.seq_slots[b]))[0]  # [ring_size, D]
            table = meta.block_tables[b].tolist()
            for t in range(q_start, q_end):
                pos = first + t - q_start
                query = fresh_row(q[t]).unsqueeze(0)  # [1, H, D]
                state = _OnlineSoftmax(1, q.shape[1], q.shape[2], query.device)
                low = max(pos - ring_spec.window + 1, since)  # window positions low..pos
                if low <= pos:
                    keys = self._window_keys(window, ring_spec, kv, q_start, first, low, pos)  # [1, n, D]
                    state.add(torch.bmm(query, keys.transpose(1, 2)) * scale, keys)
                if compressed is not None:
                    picks = None if indices is None else indices[t].tolist()
                    for keys in self._compressed_chunks(compressed, compressed_spec, table, pos, picks):
                        state.add(torch.bmm(query, keys.transpose(1, 2)) * scale, keys)
                state.add_sink(sink)
                out[t] = state.result()
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
        if ring_spec.kind is not CacheKind.SLIDING_WINDOW:
            raise ValueError(f"block_attention's window is a SLIDING_WINDOW cache, not {ring_spec.kind.value}")
        out = torch.empty_like(q)  # [T, H, D]
        sink = sinks.float().view(1, -1, 1)  # [1, H, 1]
        starts = meta.query_start_loc.tolist()
        for b, seq_len in enumerate(meta.seq_lens.tolist()):
            q_start, q_end = starts[b], starts[b + 1]
            if q_end == q_start:
                continue
            first = seq_len - (q_end - q_start)  # the block's first position
            low = max(first - ring_spec.window, int(meta.window_starts[b]), 0)
            window = self.layout.ring(ring, int(meta.seq_slots[b]))[0]  # [ring_size, D]
            keys = self._window_keys(window, ring_spec, kv, q_start, first, low, seq_len - 1)  # [1, n, D]
            for t in range(q_start, q_end):  # every query of the block sees the same keys
                state = _OnlineSoftmax(1, q.shape[1], q.shape[2], q.device)
                state.add(torch.bmm(fresh_row(q[t]).unsqueeze(0), keys.transpose(1, 2)) * scale, keys)
                state.add_sink(sink)
                out[t] = state.result()
        return out

    def _window_keys(
        self,
        window: torch.Tensor,
        spec: CacheSpec,
        kv: torch.Tensor,
        q_start: int,
        first: int,
        low: int,
        pos: int,
    ) -> torch.Tensor:
        """The K = V entries of positions low..pos in position order, as a fresh float32 [1, n, D]: those
        before `first` from the ring `window` [ring_size, D], the rest from this step's `kv` [T, D]."""
        keys = torch.empty(1, pos - low + 1, window.shape[-1], device=window.device)
        earlier = max(0, min(first, pos + 1) - low)  # positions low..first-1 are in the ring
        if earlier:
            ring_rows = torch.arange(low, low + earlier, device=window.device) % spec.ring_size
            keys[0, :earlier] = window[ring_rows]
        start = max(low, first)
        keys[0, earlier:] = kv[q_start + start - first : q_start + pos + 1 - first]
        return keys

    def _compressed_chunks(
        self, cache: torch.Tensor, spec: CacheSpec, table: list[int], pos: int, picks: list[int] | None
    ):
        """Yield, block by block, fresh float32 [1, n, D] chunks of the compressed entries a query at `pos`
        sees: entry w iff w < (pos + 1) // rate and (picks None or w in picks; -1 picks nothing), in
        increasing entry order, each entry once."""
        per_block = spec.entries_per_block(self.layout.block_size)
        visible = (pos + 1) // spec.compress_rate
        if picks is None:
            for j in range(-(-visible // per_block)):
                n = min(per_block, visible - j * per_block)
                yield fresh_row(self.layout.block(cache, table[j], n))  # [1, n, D]
            return
        by_block: dict[int, list[int]] = {}
        for w in sorted({w for w in picks if 0 <= w < visible}):
            by_block.setdefault(w // per_block, []).append(w % per_block)
        for j, offsets in by_block.items():  # in increasing block order: the entries are sorted
            entries = self.layout.block(cache, table[j], per_block)  # [1, per_block, D]
            yield fresh_row(entries[:, torch.tensor(offsets, device=cache.device)])  # [1, n, D]

    def _index_scores(
        self,
        q_row: torch.Tensor,
        gains_row: torch.Tensor,
        keys: torch.Tensor,
        spec: CacheSpec,
        table: list[int],
        visible: int,
        scale: float,
    ) -> torch.Tensor:
        """One query's indexer scores [visible] float32 over its sequence's compressed keys 0..visible-1, block by
        block: score_w = sum_h gains_h relu(q_h . k_w) * scale, for q_row [Hi, Di] and gains_row [Hi]."""
        per_block = spec.entries_per_block(self.layout.block_size)
        query = fresh_row(q_row).t()  # [Di, Hi]
        gains = fresh_row(gains_row)  # [Hi]
        scores = torch.empty(visible, device=query.device)  # [C] float32
        for j in range(-(-visible // per_block)):
            n = min(per_block, visible - j * per_block)
            entries = fresh_row(self.layout.block(keys, table[j], n)[0])  # [n, Di]
            per_head = torch.relu(torch.mm(entries, query)) * scale  # [n, Hi]
            scores[j * per_block : j * per_block + n] = torch.mv(per_head, gains)  # sum_h w_h relu(.)
        return scores

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
        if keys_spec.kind is not CacheKind.PAGED:
            raise ValueError(f"indexer_topk reads a PAGED cache of compressed keys, not {keys_spec.kind.value}")
        out = torch.full((q.shape[0], top_k), -1, dtype=torch.int64, device=q.device)  # [T, top_k]
        for t, table, pos in _query_rows(meta):
            visible = (pos + 1) // keys_spec.compress_rate  # it sees entries w < (pos + 1) // m
            if visible:
                order = _best(self._index_scores(q[t], weights[t], keys, keys_spec, table, visible, scale), top_k)
                out[t, : order.shape[0]] = order
        return out

    # ------------------------------------------------------------------ DeepSeek-V4.1 (V41AttentionOps)

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
        if keys_spec.kind is not CacheKind.PAGED:
            raise ValueError(f"indexer_select reads a PAGED cache of compressed keys, not {keys_spec.kind.value}")
        tokens = q.shape[0]
        indices = torch.full((tokens, top_k), -1, dtype=torch.int64, device=q.device)  # [T, top_k]
        blocks = torch.full((tokens, top_blocks), -1, dtype=torch.int64, device=q.device) if top_blocks else None
        for t, table, pos in _query_rows(meta):
            visible = (pos + 1) // keys_spec.compress_rate
            if visible == 0:
                continue  # no candidates and no block with a visible entry
            scores = self._index_scores(q[t], weights[t], keys, keys_spec, table, visible, scale)  # [C]
            if blocks is not None:  # from every visible entry, whatever `within` lists
                kept = _best_blocks(scores, block_size, top_blocks)
                blocks[t, : kept.shape[0]] = kept
            if within is None:
                picks = _best(scores, top_k)
            else:  # only the entries of the listed blocks (-1 lists none)
                listed = torch.isin(torch.arange(visible, device=q.device) // block_size, within[t])  # [C]
                candidates = listed.nonzero().squeeze(1)  # [n], increasing: ties still go to the lower entry
                picks = candidates[_best(scores[candidates], top_k)]
            indices[t, : picks.shape[0]] = picks
        return indices, blocks
