"""Decode and verify steps replayed from device graphs: the static inputs behind a backend's GraphCapture.

A uniform step (q new tokens for each of B sequences: q = 1 a decode step, q = 1 + drafts a verify step of
speculative decoding, each sequence padded to the step's most) has the same shapes every time for a given
(B, q), so a backend that can capture device graphs runs it as one replay instead of hundreds of launches.
`DecodeGraphs` pads B up to the next captured size, copies the step's inputs into static buffers (padding
rows write and read a scratch cache block, and a scratch sequence slot, that no sequence owns) and replays the
graph captured for that size, capturing it on first use. Models with per-sequence caches (DeepSeek-V4's rings
and compressor states) get their metadata (sequence slots, window starts, cached lengths) through static
buffers too, and `uniform_decode`, which lets them plan the step on the device.

Graphs are captured per padded batch size, per q and per block-table width bucket (powers of two from
MIN_WIDTH blocks up to the longest sequence's): work that a static shape must size by the table's width
(DeepSeek-V4's indexer scores every entry slot the table can hold) then follows the batch's context, not
max_model_len. With a draft model the graph runs the target's forward through the drafter's `target_forward`
and keeps what the drafter reads of every position (static storage as well).
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
    """Captured uniform steps of `model` for padded batch sizes up to `max_batch` and up to `max_queries` tokens
    a sequence, per block-table width bucket.

    `run` takes a uniform step's inputs (every sequence's q newest tokens) and returns the logits [B * q, V]
    float32 of the replayed graph, rows in the step's order, and what `drafter` (if given) read of them (views
    of static storage, valid until the next run).
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
        max_queries: int = 1,
        drafter=None,
    ) -> None:
        self.capture, self.model, self.caches, self.drafter = capture, model, list(caches), drafter
        self.sizes = capture_sizes(max_batch)
        self.max_batch = max_batch
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_queries = min(max_queries, block_size)  # a padding row's tokens sit in the one scratch block
        longest = self.sizes[-1] * self.max_queries

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        self._token_ids, self._positions, self._slots = zeros(longest), zeros(longest), zeros(longest)
        seqs = self.sizes[-1]
        self._seq_lens, self._seq_slots, self._window_starts, self._cached_lens = (zeros(seqs) for _ in range(4))
        self._scratch_seq_slot = scratch_seq_slot
        self._per_sequence: bool | None = None  # whether the steps carry per-sequence metadata (from the first)
        self._block_tables = torch.full((seqs, max_blocks_per_seq), -1, dtype=torch.int64, device=device)
        self._query_start_loc = torch.arange(seqs + 1, dtype=torch.int64, device=device)  # times q: q a row
        # what a padding row holds: tokens 0 at positions 0..q-1 of the scratch block, attending causally
        self._pad_block_row = torch.full((max_blocks_per_seq,), -1, dtype=torch.int64, device=device)
        self._pad_block_row[0] = scratch_block
        self._pad_positions = torch.arange(self.max_queries, device=device)
        self._pad_slots = scratch_block * block_size + self._pad_positions
        self._replays: dict[tuple[int, int, int], Callable[[], torch.Tensor]] = {}  # (size, q, width) -> replay
        self._steps: dict[tuple[int, int, int], Callable[[], torch.Tensor]] = {}  # the captured steps
        self._drafted: dict[tuple[int, int, int], torch.Tensor] = {}  # what the drafter reads, per graph

    def fits(self, num_seqs: int, block_table_width: int, queries: int = 1) -> bool:
        return (
            0 < num_seqs <= self.max_batch
            and block_table_width <= self.max_blocks_per_seq
            and 0 < queries <= self.max_queries
        )

    def run(
        self, token_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """token_ids, positions [B * q] and the step's metadata (q = meta.max_query_len tokens per sequence)
        -> (logits [B * q, V], the drafter's read of those rows or None)."""
        batch, width, q = meta.num_seqs, meta.block_tables.shape[1], meta.max_query_len
        size = self.sizes[bisect.bisect_left(self.sizes, batch)]
        bucket = self.width_bucket(width)
        tokens = batch * q
        self._token_ids[:tokens].copy_(token_ids)
        self._positions[:tokens].copy_(positions)
        self._slots[:tokens].copy_(meta.slot_mapping)
        self._seq_lens[:batch].copy_(meta.seq_lens)
        self._block_tables[:batch, :width].copy_(meta.block_tables)
        self._block_tables[:batch, width:bucket].fill_(-1)
        if self._per_sequence is None:
            self._per_sequence = meta.seq_slots is not None
        if self._per_sequence:
            self._seq_slots[:batch].copy_(meta.seq_slots)
            self._window_starts[:batch].copy_(meta.window_starts)
            self._cached_lens[:batch].copy_(meta.cached_lens)
        if size > batch:
            pads = size - batch
            self._token_ids[tokens : size * q].zero_()
            self._positions[tokens : size * q].copy_(self._pad_positions[:q].repeat(pads))
            self._slots[tokens : size * q].copy_(self._pad_slots[:q].repeat(pads))
            self._seq_lens[batch:size].fill_(q)
            self._block_tables[batch:size].copy_(self._pad_block_row.expand(pads, -1))
            if self._per_sequence:
                self._seq_slots[batch:size].fill_(self._scratch_seq_slot)
                self._window_starts[batch:size].zero_()
                self._cached_lens[batch:size].zero_()
        key = (size, q, bucket)
        replay = self._replays.get(key)
        if replay is None:
            step = self._steps[key] = self._step(*key)  # held: the graph reads the tensors it closes over
            replay = self._replays[key] = self.capture.capture(step)
        logits = replay()[:tokens]
        drafted = self._drafted.get(key)
        return logits, None if drafted is None else drafted[:tokens]

    def width_bucket(self, width: int) -> int:
        """The block-table width of the graphs that serve a step whose table is `width` blocks wide."""
        return min(max(self.MIN_WIDTH, 1 << (width - 1).bit_length()), self.max_blocks_per_seq)

    def _step(self, size: int, q: int, width: int) -> Callable[[], torch.Tensor]:
        per_sequence = (
            dict(seq_slots=self._seq_slots[:size], window_starts=self._window_starts[:size],
                 cached_lens=self._cached_lens[:size])
            if self._per_sequence else {}
        )  # fmt: skip
        tables = self._block_tables[:size, :width]
        meta = AttentionMetadata(
            self._query_start_loc[: size + 1] * q, self._seq_lens[:size], tables, self._slots[: size * q],
            max_query_len=q, uniform_decode=True, **per_sequence,
        )  # fmt: skip
        token_ids, positions = self._token_ids[: size * q], self._positions[: size * q]
        key = (size, q, width)

        def step() -> torch.Tensor:
            if self.drafter is None:
                return self.model.logits(self.model.forward(token_ids, positions, meta, self.caches))  # [size q, V]
            hidden, self._drafted[key] = self.drafter.target_forward(self.model, token_ids, positions, meta,
                                                                     self.caches)  # fmt: skip
            return self.model.logits(hidden)

        return step
