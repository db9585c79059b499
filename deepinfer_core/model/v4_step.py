"""Index bookkeeping of one DeepSeek-V4 step, shared by every layer: which compressed entries the step
finishes and where their tokens' projections are, which state rows and ring slots it writes.

Built once per forward from the attention metadata (host lists; a device-side planner is future work).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    def __init__(self, meta: AttentionMetadata, positions: torch.Tensor, block_size: int) -> None:
        if meta.seq_slots is None or meta.window_starts is None or meta.cached_lens is None:
            raise ValueError("DeepSeek-V4 needs seq_slots, window_starts and cached_lens in the attention metadata")
        self.meta, self.positions, self.block_size = meta, positions, block_size
        self.seq_slots = meta.seq_slots
        self.device = meta.seq_lens.device
        self._starts = meta.query_start_loc.tolist()
        self._ends = meta.seq_lens.tolist()
        self._slots = meta.seq_slots.tolist()
        self._cached = meta.cached_lens.tolist()
        self._tables = meta.block_tables.tolist()
        self._plans: dict[tuple[int, bool], CompressPlan] = {}
        self._rings: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _sequences(self):
        """Per sequence: (index, first token row, first position, end position)."""
        for b, end in enumerate(self._ends):
            count = self._starts[b + 1] - self._starts[b]
            yield b, self._starts[b], end - count, end

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
