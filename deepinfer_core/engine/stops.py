"""When a request stops: stop tokens, EOS, stop strings in the generated text (where one ends the text, and how
much text may still become one) and its length."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

__all__ = ["find_stop", "held_back", "stop_after"]


def stop_after(request, token: int, eos_token_ids: Collection[int], detokenize: Callable) -> tuple[str | None, object]:
    """(finish reason or None, the stop token or string) once `token` is the request's newest output token, as
    vLLM decides: a stop token or EOS (from min_tokens on; the token's text stays out), else its text is
    detokenized (`detokenize(request)` -> the new text, request.text updated) and a stop string in it cuts
    request.text there, else "length" at max_tokens or the context's end."""
    params, num_output = request.params, len(request.output_token_ids)
    if num_output >= params.min_tokens:
        if token in params.stop_token_ids:
            return "stop", token
        if token in eos_token_ids and not params.ignore_eos:
            return "stop", None
    delta = detokenize(request)
    streamed = len(request.text) - len(delta)  # text before this token's
    if params.stop and num_output > params.min_tokens and (hit := find_stop(request.text, params.stop, streamed)):
        request.text = request.text[: hit[0]]
        return "stop", hit[1]
    if request.num_known_tokens >= request.max_num_tokens:  # max_tokens, or the context
        return "length", None
    return None, None


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
