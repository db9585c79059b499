"""Stop strings in generated text: where one ends the text, and how much text may still become one."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["find_stop", "held_back"]


def find_stop(text: str, stops: Sequence[str], new_from: int) -> tuple[int, str] | None:
    """The earliest stop string in text that ends after `new_from` (in the new text), as (index, stop string)."""
    hits = [(i, s) for s in stops if (i := text.find(s, max(0, new_from - len(s) + 1))) >= 0]
    return min(hits) if hits else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of `text` may still become the start of a stop string: the longest
    suffix of text that is a proper prefix of some stop string. Streaming sends only what is before it."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest
