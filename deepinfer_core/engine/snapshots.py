"""Window snapshots: a sequence's per-sequence caches at a block boundary, kept in host memory.

DeepSeek-V4 and V4.1 keep sliding-window rings and compressor / n-gram states per sequence, not per block,
so a prefix-cache hit cannot read them from the shared blocks. When a step leaves a sequence exactly at a
block boundary, the engine copies those caches to the host (in the layout's canonical view, through
`KVLayout.gather`), keyed by the hash of the block that ends there: that hash names the whole token prefix.
A later request whose cached prefix reaches that block writes the copy into its own sequence slot
(`KVLayout.write`) and starts computing right there, with nothing replayed. The store is least recently
used first out, under a byte budget (`--window-snapshot-gb`).

Copies are queued on the device after the step that produced the state and before the next one, so they
need no synchronisation; the host waits for one only when a hit wants it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer_core.engine.request import Request
from deepinfer_core.engine.transfer import HostCopy, to_device
from deepinfer_core.kv.layout import CacheKind, CacheSpec, KVLayout

__all__ = [
    "PendingSnapshot",
    "WindowSnapshot",
    "WindowSnapshots",
    "first_needed",
    "per_sequence_caches",
    "snapshot_boundary",
]

log = logging.getLogger(__name__)

_PER_SEQUENCE = (CacheKind.SLIDING_WINDOW, CacheKind.SEQUENCE_STATE)


def per_sequence_caches(specs: Sequence[dict[str, CacheSpec]]) -> list[tuple[int, str, CacheSpec]]:
    """(layer, name, spec) of every cache that has one unit per sequence slot, in a fixed order."""
    return [
        (layer, name, spec)
        for layer, caches in enumerate(specs)
        for name, spec in caches.items()
        if spec.kind in _PER_SEQUENCE
    ]


def snapshot_boundary(num_tokens: int, block_size: int) -> int:
    """The last block boundary before a sequence's last token (0: none): a later request sharing all its
    tokens gets a prefix hit up to there, so that is where the scheduler ends a step and a snapshot is taken."""
    return (num_tokens - 1) // block_size * block_size


def first_needed(request: Request, block_size: int, snapshots: bool) -> int:
    """The first position whose final hidden state a step, or a later one, needs
    (`AttentionMetadata.needed_from`): the sequence's last token, every prompt token when prompt logprobs
    are owed, and with snapshots the token before the last block boundary (so every layer's window there
    is computed and a snapshot of it is whole)."""
    if request.needs_prompt_logprobs:
        return 0
    last, boundary = request.num_tokens - 1, snapshot_boundary(request.num_tokens, block_size)
    return boundary - 1 if snapshots and boundary > 0 else last


def _unit_slots(spec: CacheSpec, seq_slot: int) -> torch.Tensor:
    """Every slot id of sequence slot `seq_slot` in a cache of `spec` (a whole ring, or the one state)."""
    if spec.kind is CacheKind.SEQUENCE_STATE:
        return torch.tensor([seq_slot], dtype=torch.int64)
    return seq_slot * spec.ring_size + torch.arange(spec.ring_size, dtype=torch.int64)


@dataclass(frozen=True, slots=True)
class WindowSnapshot:
    window_start: int  # the snapshotted sequence's window_start: its ring entries before it are stale
    states: HostCopy  # one canonical tensor per cache of `per_sequence_caches`, landing on the host
    nbytes: int


@dataclass(frozen=True, slots=True)
class PendingSnapshot:
    """A snapshot taken at the end of the sequence's block `block_index` whose hash is not known yet (the
    block's last token may still be in flight)."""

    block_index: int
    snapshot: WindowSnapshot


class WindowSnapshots:
    def __init__(
        self,
        layout: KVLayout,
        specs: Sequence[dict[str, CacheSpec]],
        caches: list[dict[str, torch.Tensor]],
        device: torch.device,
        budget_bytes: int,
        block_size: int,
    ) -> None:
        self.layout, self.caches, self.device, self.budget_bytes = layout, caches, device, budget_bytes
        self.block_size = block_size
        self.units = per_sequence_caches(specs)
        self._store: OrderedDict[bytes, WindowSnapshot] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.hits = 0  # prefix hits that restored a snapshot
        self.evictions = 0

    @property
    def enabled(self) -> bool:
        """False when the model has no per-sequence caches or the budget cannot hold one snapshot."""
        return bool(self.units) and self.budget_bytes >= self.snapshot_bytes

    @property
    def snapshot_bytes(self) -> int:
        """Host bytes one snapshot takes (the canonical view of one sequence slot's caches)."""
        return sum(
            _unit_slots(spec, 0).numel() * torch.Size(spec.entry_shape).numel() * spec.dtype.itemsize
            for _, _, spec in self.units
        )

    def log_start(self, replay_tokens: int | None) -> None:
        """Say at start-up what a snapshot costs and what it may use, or, for a model that has per-sequence
        caches but no snapshots, what a hit replays (`replay_tokens`; None: prefix caching is off)."""
        if self.enabled:
            log.info(
                "window snapshots: %.2f MiB each, up to %.1f GiB of host memory (--window-snapshot-gb)",
                self.snapshot_bytes / 2**20,
                self.budget_bytes / 2**30,
            )
        elif self.units and replay_tokens is not None:
            log.info("window snapshots off: a prefix hit replays %d tokens", replay_tokens)

    def after_step(self, request: Request, needed: int) -> None:
        """Snapshot the request's caches if the step just issued left it at a block boundary where every
        layer computed them (not below `needed`, the step's first needed position: below it a model may have
        skipped late layers). Kept under the block's hash, or pending until that hash is known."""
        end, size = request.num_computed_tokens, self.block_size
        if request.finished:
            return
        if end == 0 or end % size or end < needed:
            self.keep_pending(request)
            return
        index = end // size - 1
        if index < len(request.block_hashes) and request.block_hashes[index] in self:
            return  # the same prefix's windows are kept already
        request.pending_snapshot = PendingSnapshot(index, self.capture(request.seq_slot, request.window_start))
        self.keep_pending(request)

    def keep_pending(self, request: Request) -> None:
        """Store the request's pending snapshot once the hash of its block is known."""
        pending = request.pending_snapshot
        if pending is not None and pending.block_index < len(request.block_hashes):
            self.put(request.block_hashes[pending.block_index], pending.snapshot)
            request.pending_snapshot = None

    @property
    def num_snapshots(self) -> int:
        return len(self._store)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._store

    def capture(self, seq_slot: int, window_start: int) -> WindowSnapshot:
        """Start copying sequence slot `seq_slot`'s caches to the host, as the queued work leaves them."""
        states = [
            self.layout.gather(self.caches[layer][name], spec, to_device(_unit_slots(spec, seq_slot), self.device))
            for layer, name, spec in self.units
        ]
        return WindowSnapshot(window_start, HostCopy(states), self.snapshot_bytes)

    def put(self, block_hash: bytes, snapshot: WindowSnapshot) -> None:
        """Keep `snapshot` as the state after the block `block_hash`; evict the least recently used to fit."""
        if block_hash in self._store or snapshot.nbytes > self.budget_bytes:
            return
        while self._store and self.nbytes + snapshot.nbytes > self.budget_bytes:
            _, old = self._store.popitem(last=False)
            self.nbytes -= old.nbytes
            self.evictions += 1
        self._store[block_hash] = snapshot
        self.nbytes += snapshot.nbytes

    def latest(self, hashes: Sequence[bytes], first: int = 0) -> int:
        """The index of the last of `hashes[first:]` (a sequence's block hash chain) with a snapshot; -1 if
        none. Marks it recently used."""
        for index in range(len(hashes) - 1, first - 1, -1):
            if hashes[index] in self._store:
                self._store.move_to_end(hashes[index])
                return index
        return -1

    def restore(self, block_hash: bytes, seq_slot: int) -> int:
        """Write the snapshot of `block_hash` into sequence slot `seq_slot`'s caches; returns its window_start."""
        snapshot = self._store[block_hash]
        for (layer, name, spec), state in zip(self.units, snapshot.states.wait()):
            slots = to_device(_unit_slots(spec, seq_slot), self.device)
            self.layout.write(self.caches[layer][name], spec, slots, state.to(self.device))
        self.hits += 1
        return snapshot.window_start
