"""Which rank takes a request (parallel/data_parallel.py's front): the seeds' rules.

Decode rule: the rank with the fewest requests in flight, then the least KV (prompt + output tokens known).
Long prompts are spread by the seeds' length buckets (< 16K, 16-64K, 64-256K, > 256K tokens): a prompt of a long
bucket goes to the rank holding the fewest of that bucket first, so that no rank gathers the long prefills (the
decode rule alone would send every long prompt to the rank with the fewest, possibly short, requests).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["LENGTH_BUCKETS", "RankLoad", "choose_rank", "length_bucket"]

LENGTH_BUCKETS = (16 * 1024, 64 * 1024, 256 * 1024)  # bucket boundaries in prompt tokens


def length_bucket(prompt_tokens: int) -> int:
    """0: under 16K tokens, 1: 16-64K, 2: 64-256K, 3: 256K or more."""
    return bisect_right(LENGTH_BUCKETS, prompt_tokens)


@dataclass
class RankLoad:
    """One rank's requests in flight: each one's prompt-length bucket and its KV tokens as last known."""

    buckets: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)

    def add(self, request_id: str, prompt_tokens: int) -> None:
        self.buckets[request_id] = length_bucket(prompt_tokens)
        self.tokens[request_id] = prompt_tokens

    def forget(self, request_id: str) -> None:
        self.buckets.pop(request_id, None)
        self.tokens.pop(request_id, None)

    @property
    def num_requests(self) -> int:
        return len(self.buckets)

    @property
    def kv_tokens(self) -> int:
        return sum(self.tokens.values())

    def in_bucket(self, bucket: int) -> int:
        return sum(1 for b in self.buckets.values() if b == bucket)


def choose_rank(loads: Sequence[RankLoad], prompt_tokens: int) -> int:
    """The rank for a prompt of `prompt_tokens` tokens (ties: the lowest rank)."""
    bucket = length_bucket(prompt_tokens)

    def key(rank: int) -> tuple[int, int, int, int]:
        load = loads[rank]
        return (load.in_bucket(bucket) if bucket else 0), load.num_requests, load.kv_tokens, rank

    return min(range(len(loads)), key=key)
