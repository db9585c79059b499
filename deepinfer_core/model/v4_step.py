"""Index bookkeeping of one DeepSeek-V4 step, shared by every layer: which compressed entries the step
finishes and where their tokens' projections are, which state rows and ring slots it writes.

Built once per forward from the attention metadata. A uniform step (q tokens for every sequence, its newest:
a decode step, `meta.max_query_len == 1`, or a verify step marked `meta.uniform_decode`) is planned with tensor
ops on the device and never reads the host, so it can be captured in a device graph; other steps are planned
from host copies of the metadata. A model that skips tokens in some layers (V4.1, v41_skip.py) narrows a step
to the tokens a layer processes.

A uniform step's compressor plan has one entry per token: the window it falls in, finished or not. An
unfinished window's entry is a provisional value in its own cache slot: no query sees an entry before its
window finishes (visible entries are those below (position + 1) // rate), and the step that finishes the
window overwrites it. Where a step holds several tokens of one window, every one of them writes the entry of
the newest (the same values to the same slot). That keeps every shape fixed by the batch size and q.
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
    where sequence b's state row for position p is b * S + p % S. S (`rows`) is the window's span plus spare
    rows: a verify step's rejected drafts (at most S - span) then overwrite no row a later window reads."""

    num_entries: int
    sources: torch.Tensor  # [E, span] int64: the table row of each slot of each finished window
    valid: torch.Tensor  # [E, span] bool: False where the slot has no token (CSA's window before the first)
    positions: torch.Tensor  # [E] int64: each entry's first token position (where it is roped)
    slots: torch.Tensor  # [E] int64: each entry's slot in the PAGED compressed cache
    state_seqs: torch.Tensor  # [N] int64: state writes: sequence (row of the gathered states) ...
    state_rows: torch.Tensor  # [N] int64: ... state row p % S ...
    state_tokens: torch.Tensor  # [N] int64: ... from this step's token row
    # [E] int64: the entry written at each of `slots` (an index into the E computed), where entries share a
    # slot (a uniform step's tokens of one window: each writes the newest's); None: each its own
    written: torch.Tensor | None = None


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
        # q: every sequence's tokens in a uniform step, planned on the device; None: planned on the host
        self.queries = None
        if host is None and (meta.uniform_decode or (meta.max_query_len == 1 and positions.shape[0] == meta.num_seqs)):
            self.queries = meta.max_query_len
            if self.queries is None or positions.shape[0] != meta.num_seqs * self.queries:
                raise ValueError(
                    f"a uniform_decode step has max_query_len tokens for each of its {meta.num_seqs} sequences; got "
                    f"{positions.shape[0]} tokens and max_query_len {meta.max_query_len}"
                )
        self.decode = self.queries is not None
        self._host_lists = host
        self._origins = origins
        self._plans: dict[tuple[int, bool], CompressPlan] = {}
        self._rings: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def _host(self) -> list:
        """query_start_loc, seq_lens, seq_slots, cached_lens and block_tables as host lists (read on first use;
        a uniform step's own plans never use them)."""
        if self._host_lists is None:
            meta = self.meta
            fields = (meta.query_start_loc, meta.seq_lens, meta.seq_slots, meta.cached_lens, meta.block_tables)
            self._host_lists = [t.tolist() for t in fields]
        return self._host_lists

    @property
    def origins(self) -> list[int]:
        return list(range(self.meta.num_seqs)) if self._origins is None else self._origins

    @property
    def _starts(self) -> list[int]:
        return self._host[0]

    @property
    def _ends(self) -> list[int]:
        return self._host[1]

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
        per_sequence = self._host[1:]
        host = [query_start_loc] + [[values[b] for b in seqs] for values in per_sequence]
        origins = [self.origins[b] for b in seqs]
        return V4Step(narrowed, self.positions[rows], self.block_size, host, origins), rows

    def _tensor(self, values, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def compress_plan(self, rate: int, overlap: bool, rows: int) -> CompressPlan:
        """The plan of compressors of `rate` (`overlap`: CSA's windows of 2 x rate) keeping `rows` state rows
        per sequence (at least the span)."""
        key = (rate, overlap, rows)
        if key not in self._plans:
            self._plans[key] = self._plan(rate, overlap, rows)
        return self._plans[key]

    def _plan(self, rate: int, overlap: bool, rows: int) -> CompressPlan:
        if self.decode and (self.queries <= rows or rate == 1):  # else tokens of one sequence share state rows
            return self._decode_plan(rate, overlap, rows)
        _, _, _, cached, tables = self._host
        span = 2 * rate if overlap else rate
        current = len(self._ends) * rows  # first table row of the step's tokens
        per_block = self.block_size // rate
        sources, valid, positions, slots, state = [], [], [], [], []
        for b, row, first, end in self._sequences():
            # windows finishing in this step, less those inside the cached prefix (already in its blocks)
            for w in range(max(first // rate, -(-cached[b] // rate)), end // rate):
                tokens = range((w - 1) * rate if overlap else w * rate, (w + 1) * rate)
                sources.append(
                    [current + row + p - first if p >= first else b * rows + p % rows if p >= 0 else 0 for p in tokens]
                )
                valid.append([p >= 0 for p in tokens])
                positions.append(w * rate)
                slots.append(tables[b][w // per_block] * per_block + w % per_block)
            state += [(b, p % rows, row + p - first) for p in range(max(first, end - rows), end)]
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

    def _token_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A uniform step's tokens, on the device: (row r, its sequence r // q, its index j = r % q among the
        sequence's tokens, its position p), each [T] int64."""
        q, r = self.queries, torch.arange(self.num_tokens, device=self.device)
        return r, r // q, r % q, self.positions.to(torch.int64)

    def _decode_plan(self, rate: int, overlap: bool, rows: int) -> CompressPlan:
        """The plan of a uniform step, on the device: token r (sequence b, position p) updates the entry of its
        window w = p // rate, finished or not (see the module docstring), from the window's tokens up to p:
        those before the sequence's first token in the step from its state rows, the rest from the step's rows.
        Every token's state row is written (q <= S, or rate 1, which keeps no state: `_plan` checks)."""
        q, span, batch = self.queries, 2 * rate if overlap else rate, self.meta.num_seqs
        per_block = self.block_size // rate
        r, b, j, p = self._token_rows()
        w = p // rate
        first = (w - 1) * rate if overlap else w * rate
        tokens = first[:, None] + torch.arange(span, device=self.device)  # [T, span] positions
        start = (p - j)[:, None]  # the sequence's first position in the step
        in_step = batch * rows + (r - j)[:, None] + tokens - start  # the step's rows follow the B x S state rows
        sources = torch.where(tokens >= start, in_step, b[:, None] * rows + tokens % rows)
        valid = (tokens >= 0) & (tokens <= p[:, None])
        blocks = self.meta.block_tables[b, w // per_block]
        written = None
        if q > 1 and rate > 1:  # the step's newest token in the same window
            written = r + torch.minimum(rate - 1 - p % rate, q - 1 - j)
        return CompressPlan(
            r.shape[0], torch.where(valid, sources, 0), valid, w * rate, blocks * per_block + w % per_block,
            b, p % rows, r, written,
        )  # fmt: skip

    def ring_writes(self, ring_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ring slots, token rows) of the step's tokens that stay in a ring of `ring_size`."""
        if ring_size not in self._rings:
            if self.decode and self.queries <= ring_size:  # every token stays: q of a sequence's newest
                rows, b, _, p = self._token_rows()
                self._rings[ring_size] = (self.seq_slots[b] * ring_size + p % ring_size, rows)
                return self._rings[ring_size]
            slots, rows = [], []
            seq_slots = self._host[2]
            for b, row, first, end in self._sequences():
                for p in range(max(first, end - ring_size), end):
                    slots.append(seq_slots[b] * ring_size + p % ring_size)
                    rows.append(row + p - first)
            self._rings[ring_size] = (self._tensor(slots), self._tensor(rows))
        return self._rings[ring_size]
