"""Index bookkeeping of one DeepSeek-V4 step, shared by every layer: which compressed entries the step
finishes and where their tokens' projections are, which state rows and ring slots it writes.

Built once per forward from the attention metadata (host lists; a device-side planner is future work).
A model that skips tokens in some layers (V4.1, v41_skip.py) narrows it to the tokens a layer processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from deepinfer_core.backend.ops import AttentionMetadata

__all__ = ["CompressPlan", "V4Step"]


@dataclass(frozen=True, slots=True)
class CompressPlan:
    """For compressors of one rate. Sources index a table of [B * S state rows, then the step's T rows],
    where sequence b's state row for position p is b * S + p % S (S = span)."""

    num_entries: int
    sources: torch.Tensor  # [E, span] int64: the table row of each slot of each finished window
    valid: torch.Tensor  # [E, span] bool: False where the slot has no token (CSA's window before the first)
    positions: torch.Tensor  # [E] int64: each entry's first token position (where it is roped)
    slots: torch.Tensor  # [E] int64: each entry's slot in the PAGED compressed cache
    state_seqs: torch.Tensor  # [N] int64: state writes: sequence (row of the gathered states) ...
    state_rows: torch.Tensor  # [N] int64: ... state row p % S ...
    state_tokens: torch.Tensor  # [N] int64: ... from this step's token row


class V4Step:
    def __init__(
        self,
        meta: AttentionMetadata,
        positions: torch.Tensor,
        block_size: int,
        host: list | None = None,
        origins: list[int] | None = None,
    ) -> None:
        """`host`: meta's query_start_loc, seq_lens, seq_slots, cached_lens and block_tables as host lists,
        when the caller has them (`suffix`); read from the device otherwise. `origins`: each sequence's index
        in the batch of the step this one was narrowed from (`suffix`), if it was."""
        if meta.seq_slots is None or meta.window_starts is None or meta.cached_lens is None:
            raise ValueError("DeepSeek-V4 needs seq_slots, window_starts and cached_lens in the attention metadata")
        self.meta, self.positions, self.block_size = meta, positions, block_size
        self.seq_slots = meta.seq_slots
        self.device = meta.seq_lens.device
        if host is None:
            fields = (meta.query_start_loc, meta.seq_lens, meta.seq_slots, meta.cached_lens, meta.block_tables)
            host = [t.tolist() for t in fields]
        self._starts, self._ends, self._slots, self._cached, self._tables = host
        self.origins = list(range(len(self._ends))) if origins is None else origins
        self._plans: dict[tuple[int, bool], CompressPlan] = {}
        self._rings: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _sequences(self):
        """Per sequence: (index, first token row, first position, end position)."""
        for b, end in enumerate(self._ends):
            count = self._starts[b + 1] - self._starts[b]
            yield b, self._starts[b], end - count, end

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    def suffix(self, starts: Sequence[int]) -> tuple[V4Step, torch.Tensor | None]:
        """This step restricted to each sequence's tokens at positions >= its entry of `starts` (one per
        sequence of the step first built, that `origins` index), and the rows [T'] of this step's tokens it
        keeps; (this step, None) when it keeps them all.

        A sequence's tokens in a step are its last ones, so a suffix of them is kept and its seq_lens stay;
        a sequence left with none drops out of every per-sequence field. window_starts rise to the start: a
        layer run on the narrower step writes no ring entry below it, so the ring holds older ones there.
        """
        firsts = [starts[b] for b in self.origins]
        spans = [  # (sequence, first kept row, end row)
            (b, row + max(firsts[b] - first, 0), row + end - first)
            for b, row, first, end in self._sequences()
            if firsts[b] < end
        ]
        counts = [stop - start for _, start, stop in spans]
        if sum(counts) == self.num_tokens:
            return self, None
        seqs = [b for b, _, _ in spans]
        rows = torch.cat([torch.arange(start, stop) for _, start, stop in spans] or [torch.zeros(0, dtype=torch.int64)])
        index, rows = self._tensor(seqs), rows.to(self.device)
        meta, query_start_loc = self.meta, list(accumulate(counts, initial=0))
        narrowed = AttentionMetadata(
            query_start_loc=self._tensor(query_start_loc),
            seq_lens=meta.seq_lens[index],
            block_tables=meta.block_tables[index],
            slot_mapping=meta.slot_mapping[rows],
            seq_slots=meta.seq_slots[index],
            window_starts=torch.maximum(meta.window_starts[index], self._tensor([firsts[b] for b in seqs])),
            cached_lens=meta.cached_lens[index],
            needed_from=None if meta.needed_from is None else meta.needed_from[index],
        )
        per_sequence = (self._ends, self._slots, self._cached, self._tables)
        host = [query_start_loc] + [[values[b] for b in seqs] for values in per_sequence]
        origins = [self.origins[b] for b in seqs]
        return V4Step(narrowed, self.positions[rows], self.block_size, host, origins), rows

    def _tensor(self, values, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def compress_plan(self, rate: int, overlap: bool) -> CompressPlan:
        key = (rate, overlap)
        if key not in self._plans:
            self._plans[key] = self._plan(rate, overlap)
        return self._plans[key]

    def _plan(self, rate: int, overlap: bool) -> CompressPlan:
        span = 2 * rate if overlap else rate
        current = len(self._ends) * span  # first table row of the step's tokens
        per_block = self.block_size // rate
        sources, valid, positions, slots, state = [], [], [], [], []
        for b, row, first, end in self._sequences():
            # windows finishing in this step, less those inside the cached prefix (already in its blocks)
            for w in range(max(first // rate, -(-self._cached[b] // rate)), end // rate):
                tokens = range((w - 1) * rate if overlap else w * rate, (w + 1) * rate)
                sources.append(
                    [current + row + p - first if p >= first else b * span + p % span if p >= 0 else 0 for p in tokens]
                )
                valid.append([p >= 0 for p in tokens])
                positions.append(w * rate)
                slots.append(self._tables[b][w // per_block] * per_block + w % per_block)
            state += [(b, p % span, row + p - first) for p in range(max(first, end - span), end)]
        state_seqs, state_rows, state_tokens = zip(*state) if state else ((), (), ())
        return CompressPlan(
            len(positions),
            self._tensor(sources).view(-1, span),
            self._tensor(valid, torch.bool).view(-1, span),
            self._tensor(positions),
            self._tensor(slots),
            self._tensor(state_seqs),
            self._tensor(state_rows),
            self._tensor(state_tokens),
        )

    def ring_writes(self, ring_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ring slots, token rows) of the step's tokens that stay in a ring of `ring_size`."""
        if ring_size not in self._rings:
            slots, rows = [], []
            for b, row, first, end in self._sequences():
                for p in range(max(first, end - ring_size), end):
                    slots.append(self._slots[b] * ring_size + p % ring_size)
                    rows.append(row + p - first)
            self._rings[ring_size] = (self._tensor(slots), self._tensor(rows))
        return self._rings[ring_size]
