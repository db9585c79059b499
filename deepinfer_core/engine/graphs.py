"""Decode steps replayed from device graphs: the static inputs behind a backend's GraphCapture.

A decode step (one new token for each of B sequences) has the same shapes every time for a given B,
so a backend that can capture device graphs runs it as one replay instead of hundreds of launches.
`DecodeGraphs` pads B up to the next captured size, copies the step's inputs into static buffers
(padding rows write and read a scratch cache block, and a scratch sequence slot, that no sequence owns)
and replays the graph captured for that size, capturing it on first use. Models with per-sequence caches
(DeepSeek-V4's rings and compressor states) get their metadata (sequence slots, window starts, cached
lengths) through static buffers too, and `max_query_len` 1, which lets them plan the step on the device.

Graphs are captured per padded batch size and per block-table width bucket (powers of two from MIN_WIDTH
blocks up to the longest sequence's): work that a static shape must size by the table's width (DeepSeek-V4's
indexer scores every entry slot the table can hold) then follows the batch's context, not max_model_len.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

from deepinfer_core.backend import GraphCapture  # the contract's; re-exported here
from deepinfer_core.backend.ops import AttentionMetadata

__all__ = ["DecodeGraphs", "GraphCapture", "capture_sizes"]


def capture_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then every multiple of 16 up to max_batch (and max_batch)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    """Captured decode steps of `model` for padded batch sizes up to `max_batch`, per block-table width bucket.

    `run` takes a decode step's inputs (one query per sequence, every row sampled) and returns the
    logits [B, V] float32 of the replayed graph (a view of static storage, valid until the next run).
    """

    MIN_WIDTH = 16  # blocks: the narrowest block table a graph is captured with

    def __init__(
        self,
        capture: GraphCapture,
        model,
        caches: Sequence[torch.Tensor],
        *,
        device: torch.device,
        block_size: int,
        max_batch: int,
        max_blocks_per_seq: int,
        scratch_block: int,
        scratch_seq_slot: int,
    ) -> None:
        self.capture, self.model, self.caches = capture, model, list(caches)
        self.sizes = capture_sizes(max_batch)
        self.max_batch = max_batch
        self.max_blocks_per_seq = max_blocks_per_seq
        longest = self.sizes[-1]

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        self._token_ids, self._positions, self._seq_lens = zeros(longest), zeros(longest), zeros(longest)
        self._slots = zeros(longest)
        self._seq_slots, self._window_starts, self._cached_lens = zeros(longest), zeros(longest), zeros(longest)
        self._scratch_seq_slot = scratch_seq_slot
        self._per_sequence: bool | None = None  # whether the steps carry per-sequence metadata (from the first)
        self._block_tables = torch.full((longest, max_blocks_per_seq), -1, dtype=torch.int64, device=device)
        self._query_start_loc = torch.arange(longest + 1, dtype=torch.int64, device=device)  # one query per row
        # what a padding row holds: token 0 at position 0 of the scratch block, attending to itself
        self._pad_block_row = torch.full((max_blocks_per_seq,), -1, dtype=torch.int64, device=device)
        self._pad_block_row[0] = scratch_block
        self._pad_slot = scratch_block * block_size
        self._replays: dict[tuple[int, int], Callable[[], torch.Tensor]] = {}  # (size, width) -> replay

    def fits(self, num_seqs: int, block_table_width: int) -> bool:
        return 0 < num_seqs <= self.max_batch and block_table_width <= self.max_blocks_per_seq

    def run(self, token_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """token_ids, positions [B] and the step's metadata (q_len 1 per sequence) -> logits [B, V]."""
        batch, width = meta.num_seqs, meta.block_tables.shape[1]
        size = self.sizes[bisect.bisect_left(self.sizes, batch)]
        bucket = self.width_bucket(width)
        self._token_ids[:batch].copy_(token_ids)
        self._positions[:batch].copy_(positions)
        self._seq_lens[:batch].copy_(meta.seq_lens)
        self._slots[:batch].copy_(meta.slot_mapping)
        self._block_tables[:batch, :width].copy_(meta.block_tables)
        self._block_tables[:batch, width:bucket].fill_(-1)
        if self._per_sequence is None:
            self._per_sequence = meta.seq_slots is not None
        if self._per_sequence:
            self._seq_slots[:batch].copy_(meta.seq_slots)
            self._window_starts[:batch].copy_(meta.window_starts)
            self._cached_lens[:batch].copy_(meta.cached_lens)
        if size > batch:
            self._token_ids[batch:size].zero_()
            self._positions[batch:size].zero_()
            self._seq_lens[batch:size].fill_(1)
            self._slots[batch:size].fill_(self._pad_slot)
            self._block_tables[batch:size].copy_(self._pad_block_row.expand(size - batch, -1))
            if self._per_sequence:
                self._seq_slots[batch:size].fill_(self._scratch_seq_slot)
                self._window_starts[batch:size].zero_()
                self._cached_lens[batch:size].zero_()
        replay = self._replays.get((size, bucket))
        if replay is None:
            replay = self._replays[size, bucket] = self.capture.capture(self._step(size, bucket))
        return replay()[:batch]

    def width_bucket(self, width: int) -> int:
        """The block-table width of the graphs that serve a step whose table is `width` blocks wide."""
        return min(max(self.MIN_WIDTH, 1 << (width - 1).bit_length()), self.max_blocks_per_seq)

    def _step(self, size: int, width: int) -> Callable[[], torch.Tensor]:
        per_sequence = (
            dict(seq_slots=self._seq_slots[:size], window_starts=self._window_starts[:size],
                 cached_lens=self._cached_lens[:size])
            if self._per_sequence else {}
        )  # fmt: skip
        tables = self._block_tables[:size, :width]
        meta = AttentionMetadata(
            self._query_start_loc[: size + 1], self._seq_lens[:size], tables, self._slots[:size],
            max_query_len=1, **per_sequence,
        )  # fmt: skip
        token_ids, positions = self._token_ids[:size], self._positions[:size]

        def step() -> torch.Tensor:
            return self.model.logits(self.model.forward(token_ids, positions, meta, self.caches))  # [size, V]

        return step
