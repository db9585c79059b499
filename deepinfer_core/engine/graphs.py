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
and keeps what the drafter reads of every position (static storage as well); after sampling, `draft` replays a
second graph of the same key: the drafter's catch-up over the step and its k drafts from each sequence's last
accepted position (acceptance counted in the graph from the sampled tokens, which the caller copies in).
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
        self.num_model_caches, self.model_block_size = len(model.cache_specs), block_size  # the drafter's follow
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
        # every graph's outputs are copied into these, allocated at the first capture: a graph then keeps nothing
        # of its own past its capture, and all of them share one pool (a graph per size, q and width bucket would
        # otherwise each hold its logits [size q, V])
        self._logits: torch.Tensor | None = None  # [longest, V] float32
        self._drafted: torch.Tensor | None = None  # [longest, ...]: what the drafter reads of each row
        self._longest = longest
        # the draft graphs: their inputs (the step's sampled tokens in its rows, each sequence's drafts verified and
        # last position), replays, and what the drafter's confidence head gave, if it has one
        self._sampled = zeros(longest)
        self._num_drafts, self._limits = zeros(seqs), zeros(seqs)
        self._pad_limit = block_size - 1  # a padding row's drafts stay in the scratch block
        self._draft_replays: dict[tuple[int, int, int], Callable[[], torch.Tensor]] = {}
        self._draft_steps: dict[tuple[int, int, int], Callable[[], torch.Tensor]] = {}
        self._confidence: dict[tuple[int, int, int], torch.Tensor] = {}
        self._last: tuple[tuple[int, int, int], int] | None = None  # the key and batch of the last run

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
        self._last = key, batch
        return logits, None if self._drafted is None else self._drafted[:tokens]

    def draft(
        self, sampled: torch.Tensor, num_drafts: torch.Tensor, limits: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """After `run` (with a drafter): sampled [B * q] (the token sampled at each row of the step, 0 at filler
        rows), num_drafts [B] (each sequence's drafts verified), limits [B] (the last position its blocks and the
        model hold) -> (drafts [B, k], confidences [B, k] or None), replayed from the draft graph of that step."""
        key, batch = self._last
        size, q, _ = key
        tokens = batch * q
        self._sampled[:tokens].copy_(sampled)
        self._sampled[tokens : size * q].zero_()
        self._num_drafts[:batch].copy_(num_drafts)
        self._num_drafts[batch:size].zero_()
        self._limits[:batch].copy_(limits)
        self._limits[batch:size].fill_(self._pad_limit)
        replay = self._draft_replays.get(key)
        if replay is None:
            step = self._draft_steps[key] = self._draft_step(key, k)  # held, as the target's steps are
            replay = self._draft_replays[key] = self.capture.capture(step)
        # copied out of the graph's memory: they outlive the step (the next one reads them on the device), and a
        # graph's outputs last only until another graph of its memory pool runs (another engine's, in one process)
        drafts = replay()[:batch].clone()
        confidence = self._confidence.get(key)
        return drafts, None if confidence is None else confidence[:batch].clone()

    def _draft_step(self, key: tuple[int, int, int], k: int) -> Callable[[], torch.Tensor]:
        from deepinfer_core.model.mtp import DraftInputs  # a model module: needed only with a drafter

        size, q, _ = key
        target = self._steps[key]
        device = self._sampled.device
        rows = torch.arange(size * q, device=device)  # every row "sampled": the filler's are never read
        first = torch.arange(size, device=device) * q
        seqs = torch.arange(size, device=device)
        checked = torch.arange(q - 1, device=device)

        def step() -> torch.Tensor:
            sampled = self._sampled[: size * q]
            inputs = self._token_ids[: size * q].view(size, q)
            # a sequence keeps its leading drafts that equal the token sampled before them
            matches = (sampled.view(size, q)[:, :-1] == inputs[:, 1:]) & (checked < self._num_drafts[:size, None])
            accepted = matches.to(torch.int64).cumprod(dim=1).sum(dim=1)
            step_inputs = DraftInputs(
                sampled, target.positions, self._drafted[: size * q], target.meta, rows, first, seqs, accepted,
                self._limits[:size], self.model_block_size,
            )  # fmt: skip
            drafts = self.drafter.draft(step_inputs, self.caches[self.num_model_caches :], k)
            if isinstance(drafts, tuple):  # a confidence head (DSpark)
                drafts, self._confidence[key] = drafts
            return drafts

        return step

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

        def step() -> torch.Tensor:
            if self.drafter is None:
                hidden = self.model.forward(token_ids, positions, meta, self.caches)
            else:
                hidden, drafted = self.drafter.target_forward(self.model, token_ids, positions, meta, self.caches)
                self._drafted = self._static(self._drafted, drafted)
                self._drafted[: size * q].copy_(drafted)
            logits = self.model.logits(hidden)  # [size q, V]
            self._logits = self._static(self._logits, logits)
            return self._logits[: size * q].copy_(logits)

        step.positions, step.meta = positions, meta  # what the draft graph of the same key reads
        return step

    def _static(self, buffer: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        """`buffer`, or (at the first capture, before any graph holds it) a new one of `like`'s row shape and dtype
        for the longest step."""
        if buffer is None:
            buffer = like.new_empty((self._longest, *like.shape[1:]))
        return buffer
