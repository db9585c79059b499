"""Engine limits checked where they are set, so a bad value is refused with its flag's name at start-up
instead of starting an engine that hangs or fails later."""

from __future__ import annotations

from deepinfer_core.errors import DeepInferError, RequestError

__all__ = ["at_least_one", "context_length", "gib_bytes", "tokens_needed"]


def at_least_one(name: str, value: int | None) -> None:
    """Refuse a count or size (None: unset) below 1, naming it as the API and the command line spell it."""
    if value is not None and value < 1:
        raise DeepInferError(f"{name} (--{name.replace('_', '-')}) must be at least 1, got {value}")


def gib_bytes(name: str, gib: float) -> int:
    """A size given in GiB (0 or more, as `name` / --name spells it) in bytes."""
    if not isinstance(gib, int | float) or isinstance(gib, bool) or not gib >= 0:
        raise DeepInferError(f"{name} (--{name.replace('_', '-')}) must be a number of GiB, 0 or more, got {gib!r}")
    return int(gib * (1 << 30))


def context_length(max_model_len: int | None, model_limit: int) -> int:
    """The engine's context in tokens: max_model_len, or the model's max_position_embeddings when unset.
    A longer max_model_len is refused (positions past the model's limit have no rotary embedding)."""
    if max_model_len is None:
        return model_limit
    if max_model_len > model_limit:
        raise DeepInferError(
            f"max_model_len (--max-model-len) {max_model_len} is longer than the model's context of {model_limit} "
            f"tokens (max_position_embeddings in its config.json); lower --max-model-len to {model_limit} or less, "
            "or leave it unset to use the model's"
        )
    return max_model_len


def tokens_needed(prompt_tokens: int, max_tokens: int, max_model_len: int, kv_capacity: int) -> int:
    """The most tokens a request may reach (its prompt and max_tokens, within the context); a RequestError saying
    what to change where its prompt leaves no room in the context or it may outgrow the whole KV cache."""
    if prompt_tokens >= max_model_len:
        raise RequestError(
            f"the prompt has {prompt_tokens} tokens but the model's context is {max_model_len} tokens "
            f"(it must leave room for at least one generated token)"
        )
    needed = min(prompt_tokens + max_tokens, max_model_len)
    if needed > kv_capacity:
        raise RequestError(
            f"the request may need {needed} tokens of KV cache (prompt {prompt_tokens} + "
            f"max_tokens {max_tokens}) but the cache holds {kv_capacity}; lower max_tokens "
            f"or give the engine more KV memory"
        )
    return needed
