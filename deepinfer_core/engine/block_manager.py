"""KV block bookkeeping: block ids, reference counts, and prefix caching over full blocks.

A full block is identified by a hash chain: hash(parent block's hash, the block's token ids), so a
block is reusable by any request whose tokens up to and including that block are identical. Freed
blocks that hold a cached prefix stay findable until evicted, least recently freed first; blocks
without a hash are handed out before any cached one.

Models with per-sequence caches (DeepSeek-V4's sliding windows and compressor state) do not store those
per block: a request admitted with a cached prefix recomputes the last `replay_tokens` tokens before
its end to rebuild them, and reads everything else from the cached blocks. Each running request also
holds one sequence slot for those caches. How many tokens is the engine's choice (`prefix_replay_tokens`).
Where a window snapshot of a hit block's end is kept (engine/snapshots.py), the request instead starts
there with the snapshot written into its slot: exact, and nothing before it is recomputed.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from deepinfer_core.engine.request import Request
from deepinfer_core.engine.snapshots import WindowSnapshots
from deepinfer_core.errors import DeepInferError

__all__ = [
    "BOUNDED_REPLAY_TOKENS",
    "PREFIX_REPLAYS",
    "BlockManager",
    "exact_replay_tokens",
    "PrefixReplay",
    "check_prefix_replay",
    "hash_block",
    "prefix_replay_tokens",
]

PrefixReplay = Literal["exact", "bounded"]  # --prefix-replay
PREFIX_REPLAYS: tuple[str, ...] = get_args(PrefixReplay)
# what DeepSeek's own V4.1 engine recomputes before a prefix hit's end: one 128-token KV block
BOUNDED_REPLAY_TOKENS = 128


def check_prefix_replay(value: object) -> str:
    """`value` if it is one of PREFIX_REPLAYS; else a DeepInferError saying what each one does."""
    if value not in PREFIX_REPLAYS:
        raise DeepInferError(
            f"prefix_replay (--prefix-replay) must be 'exact' (a prefix hit recomputes every token the model's "
            f"windows at the hit's end depend on) or 'bounded' (only the last {BOUNDED_REPLAY_TOKENS}: faster, "
            f"approximate), got {value!r}"
        )
    return value


def exact_replay_tokens(model, drafter=None) -> int:
    """Tokens a prefix hit replays to rebuild the model's per-sequence caches exactly (0: none to rebuild),
    and a drafter's on top of them (an MTP layer's window, over the model's hidden states)."""
    exact = getattr(model, "replay_tokens", 0)
    return exact + getattr(drafter, "replay_tokens", 0) if exact else 0


def prefix_replay_tokens(prefix_replay: str, exact: int) -> int:
    """Tokens a prefix hit recomputes before its end, given the model's `exact` replay (0: nothing to rebuild).

    "exact": all of them; the caches at the hit's end are what a full computation gives. "bounded": at most
    BOUNDED_REPLAY_TOKENS. The first replayed tokens then see windows cut at the replay's start, so from the
    second layer on the windows and states rebuilt at the hit's end (and the logits just past it) differ from
    a full computation (bench/prefix_replay.py measures by how much). One layer's window (DeepSeek's: 128
    tokens) fits in the replayed block, so every state is still rebuilt from the tokens it reads."""
    return exact if prefix_replay == "exact" else min(exact, BOUNDED_REPLAY_TOKENS)


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(b"".join(t.to_bytes(4, "little", signed=True) for t in token_ids))
    return digest.digest()


@dataclass(slots=True)
class _Block:
    ref_count: int = 0
    hash: bytes | None = None


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        *,
        num_seq_slots: int | None = None,
        replay_tokens: int = 0,
        snapshots: WindowSnapshots | None = None,
    ) -> None:
        self.block_size = block_size
        self.snapshots = snapshots if snapshots is not None and snapshots.enabled else None
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.replay_tokens = replay_tokens
        self.num_seq_slots = num_seq_slots  # None: as many as requests (a model without per-sequence caches)
        self._returned_seq_slots: list[int] = []
        self._next_seq_slot = 0
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # eviction order
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _prefix_hits(self, request: Request) -> tuple[list[int], list[bytes]]:
        """Cached blocks that match the request's leading full blocks. The block holding its last
        token never counts, so at least one token is always computed (its logits are needed). A request
        still owed prompt logprobs takes no hit: every prompt position's logits are needed (as vLLM)."""
        if not self.enable_prefix_caching or request.needs_prompt_logprobs:
            return [], []
        tokens, size = request.all_token_ids, self.block_size
        blocks, hashes, parent = [], [], None
        for i in range((len(tokens) - 1) // size):
            parent = hash_block(parent, tokens[i * size : (i + 1) * size])
            block_id = self._cached.get(parent)
            if block_id is None:
                break
            blocks.append(block_id)
            hashes.append(parent)
        return blocks, hashes

    def admit(self, request: Request, num_new_tokens: int) -> bool:
        """Give a waiting request its cached prefix plus blocks for its first `num_new_tokens` tokens
        computed (from `cached_prefix_tokens`, which the callers use to size the chunk). All or nothing;
        False also when no sequence slot is free."""
        hits, hashes = self._prefix_hits(request)
        cached = len(hits) * self.block_size
        start, snapshot = self._start(hashes)
        reused_free = sum(1 for b in hits if self._blocks[b].ref_count == 0)
        needed = max(self.blocks_for(start + num_new_tokens) - len(hits), 0)
        if self.num_free_blocks - reused_free < needed or not self._seq_slot_free():
            return False
        for block_id in hits:
            self._take(block_id)
        request.block_ids = hits + [self._pop_free() for _ in range(needed)]
        request.block_hashes = hashes
        request.num_cached_tokens = cached
        request.num_computed_tokens = request.window_start = start
        request.seq_slot = self._take_seq_slot()
        if snapshot >= 0:
            request.window_start = self.snapshots.restore(hashes[snapshot], request.seq_slot)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += cached
        return True

    def cached_prefix_tokens(self, request: Request) -> int:
        """The position `admit` would start computing the request from right now: its cached prefix,
        less the tokens replayed to rebuild per-sequence caches."""
        return self._start(self._prefix_hits(request)[1])[0]

    def _start(self, hashes: list[bytes]) -> tuple[int, int]:
        """Where a request whose cached prefix has block hashes `hashes` starts computing, and the index in
        `hashes` of the window snapshot it restores there (-1: none; it replays from the start instead). A
        snapshot is taken when it is no earlier than the replay's start."""
        cached = len(hashes) * self.block_size
        start = max(0, cached - self.replay_tokens)
        if self.snapshots is None or start == cached:
            return start, -1
        snapshot = self.snapshots.latest(hashes, first=max(0, -(-start // self.block_size) - 1))
        return (start, -1) if snapshot < 0 else ((snapshot + 1) * self.block_size, snapshot)

    def grow(self, request: Request, num_tokens: int) -> bool:
        """Make the request's blocks cover `num_tokens` tokens. False (and no change) if blocks ran out."""
        needed = self.blocks_for(num_tokens) - len(request.block_ids)
        if needed > self.num_free_blocks:
            return False
        request.block_ids += [self._pop_free() for _ in range(max(needed, 0))]
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly completed blocks (after a step) in the prefix cache. Only blocks
        whose tokens are all known count: a token still in flight cannot be hashed yet."""
        if not self.enable_prefix_caching:
            return
        tokens, size = request.all_token_ids, self.block_size
        full = min(request.num_computed_tokens, len(tokens)) // size
        for i in range(len(request.block_hashes), full):
            parent = request.block_hashes[-1] if request.block_hashes else None
            block_hash = hash_block(parent, tokens[i * size : (i + 1) * size])
            request.block_hashes.append(block_hash)
            if block_hash not in self._cached:  # an identical block computed elsewhere stays the cached one
                self._cached[block_hash] = request.block_ids[i]
                self._blocks[request.block_ids[i]].hash = block_hash

    def free(self, request: Request) -> None:
        """Release the request's blocks; its cached tail blocks become the first to be evicted."""
        for block_id in reversed(request.block_ids):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.hash is None:
                    self._free.move_to_end(block_id, last=False)  # nothing to keep: hand out first
        request.block_ids, request.block_hashes = [], []
        if request.seq_slot >= 0:
            self._returned_seq_slots.append(request.seq_slot)
            request.seq_slot = -1

    def _seq_slot_free(self) -> bool:
        return bool(self._returned_seq_slots) or self.num_seq_slots is None or self._next_seq_slot < self.num_seq_slots

    def _take_seq_slot(self) -> int:
        if self._returned_seq_slots:
            return self._returned_seq_slots.pop()
        self._next_seq_slot += 1
        return self._next_seq_slot - 1

    def _take(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        if block.hash is not None:  # evict the cached prefix it held
            del self._cached[block.hash]
            block.hash = None
        block.ref_count = 1
        return block_id
