"""The size check that refuses, before any tokenizing, a prompt too big for the context (the routes then
encode in a worker thread: a multi-megabyte prompt takes seconds, and on the event loop it would hold up
/health and every stream meanwhile).

A token stands for at most `Tokenizer.max_token_bytes()` bytes of text, so a prompt of more than
max_model_len times that many UTF-8 bytes cannot fit whatever its tokens turn out to be. Tokenizers
without such a bound get no early refusal; the context check after encoding refuses what does not fit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer_core.serve.errors import ApiError

if TYPE_CHECKING:
    from deepinfer_core.serve.state import ServerState

__all__ = ["check_prompt_fits"]


def check_prompt_fits(state: ServerState, text: str, param: str | None) -> None:
    """Raise a 400 when `text` has more UTF-8 bytes than the context's tokens can hold."""
    if state.max_token_bytes is None:
        return
    limit = state.max_model_len * state.max_token_bytes
    if len(text) <= limit // 4:  # 4 bytes per character at most: no need to measure
        return
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise ApiError(
            400,
            f"prompt of {size} bytes cannot fit in the context of {state.max_model_len} tokens: a token stands "
            f"for at most {state.max_token_bytes} bytes of text, so the context holds at most {limit} bytes. "
            "Please shorten the prompt.",
            param=param,
        )
