"""The prompt forms the offline API takes (vLLM's), their token ids, and chat conversations rendered with
deepseek-recipe."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypedDict

from deepinfer_core.errors import DeepInferError, RequestError

__all__ = [
    "ChatRenderer",
    "PromptType",
    "TextPrompt",
    "TokensPrompt",
    "encode_prompt",
    "normalize_conversations",
    "normalize_prompts",
]


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


PromptType = str | Sequence[int] | TextPrompt | TokensPrompt
ACCEPTED = "a string, a list of token ids, {'prompt': str}, {'prompt_token_ids': [int, ...]}, or a list of these"
_THINKING_KEYS = ("thinking", "enable_thinking")


def _token_ids(value: Any, where: str) -> list[int]:
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Sequence):
        raise DeepInferError(f"{where} must be a list of token ids (ints), got {type(value).__name__}")
    ids = []
    for i, token in enumerate(value):
        try:
            if isinstance(token, bool):
                raise TypeError
            ids.append(operator.index(token))
        except TypeError:
            raise DeepInferError(f"{where}[{i}] must be a token id (int), got {token!r}") from None
    return ids


def _one(prompt: Any, where: str) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping):
        keys = set(prompt)
        if keys == {"prompt"}:
            if not isinstance(prompt["prompt"], str):
                raise DeepInferError(f"{where}['prompt'] must be a string, got {type(prompt['prompt']).__name__}")
            return prompt["prompt"]
        if keys == {"prompt_token_ids"}:
            return _token_ids(prompt["prompt_token_ids"], f"{where}['prompt_token_ids']")
        raise DeepInferError(
            f"{where} is a dict with keys {sorted(keys)}; a prompt dict has exactly one key, 'prompt' (text) or "
            "'prompt_token_ids' (a list of token ids)"
        )
    if isinstance(prompt, Sequence) and not isinstance(prompt, bytes):
        return _token_ids(prompt, where)
    raise DeepInferError(f"{where} is a {type(prompt).__name__}; a prompt is {ACCEPTED}")


def normalize_prompts(prompts: PromptType | Sequence[PromptType]) -> list[str | list[int]]:
    """The batch as engine prompts (text or token ids), in order. A lone prompt is a batch of one; a list of
    ints is one token prompt, not a batch."""
    if isinstance(prompts, str | Mapping):
        return [_one(prompts, "prompt")]
    if isinstance(prompts, bytes) or not isinstance(prompts, Sequence):
        raise DeepInferError(f"prompts is a {type(prompts).__name__}; a prompt is {ACCEPTED}")
    if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [list(prompts)]
    return [_one(p, f"prompts[{i}]") for i, p in enumerate(prompts)]


def _is_message(value: Any) -> bool:
    return isinstance(value, Mapping)


def normalize_conversations(messages: Any) -> list[list[dict]]:
    """One conversation (a list of message dicts) or a batch of them, as a list of conversations."""
    shape = "a list of message dicts ({'role': ..., 'content': ...}), or a list of such lists"
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence) or not messages:
        raise DeepInferError(f"messages must be {shape}, got {type(messages).__name__ if messages else 'nothing'}")
    if all(_is_message(m) for m in messages):
        return [list(messages)]
    for i, conversation in enumerate(messages):
        if (
            isinstance(conversation, str | bytes | Mapping)
            or not isinstance(conversation, Sequence)
            or not conversation
            or not all(_is_message(m) for m in conversation)
        ):
            raise DeepInferError(f"messages[{i}] is not a non-empty list of message dicts; messages must be {shape}")
    return [list(c) for c in messages]


class ChatRenderer:
    """Renders OpenAI-style conversations to prompt token ids exactly as the server does (deepseek-recipe's
    request conversion and DeepSeek-V4 prompt encoding)."""

    def __init__(self, tokenizer_file: Path, model_name: str) -> None:
        from deepinfer_core.serve.state import build_recipe

        self.model_name = model_name
        _, self.encoding, self.options = build_recipe(str(tokenizer_file), model_name)

    def render(
        self,
        conversation: list[dict],
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict] | None = None,
    ) -> tuple[str, list[int]]:
        """(prompt text, prompt token ids) of one conversation, ending where the assistant's reply starts.

        chat_template_kwargs: "thinking" / "enable_thinking" (bool: thinking mode, off by default) and
        "reasoning_effort" (str, as in the OpenAI API).
        """
        import deepseek_recipe as dr

        body: dict[str, Any] = {
            "model": self.model_name,
            "messages": conversation,
            **_template_fields(chat_template_kwargs),
        }
        if tools is not None:
            body["tools"] = tools
        try:
            converted = dr.ChatCompletionRequest(body).convert(self.options)
            ids = self.encoding.encode(converted.conversation)
            text = self.encoding.render_conversation(converted.conversation).prompt
        except (ValueError, TypeError, OverflowError, RecursionError, dr.ConversionError) as err:
            raise DeepInferError(f"invalid chat messages: {str(err).removeprefix('invalid request body: ')}") from None
        return text, list(ids)


def _template_fields(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Request-body fields for chat_template_kwargs (the spellings vLLM users pass for DeepSeek models)."""
    fields: dict[str, Any] = {}
    for key, value in (kwargs or {}).items():
        if key in _THINKING_KEYS:
            if not isinstance(value, bool):
                raise DeepInferError(f"chat_template_kwargs[{key!r}] must be True or False, got {value!r}")
            fields["thinking"] = {"type": "enabled" if value else "disabled"}
        elif key == "reasoning_effort":
            fields["reasoning_effort"] = value
        else:
            raise DeepInferError(
                f"chat_template_kwargs has an unknown key {key!r}; DeepSeek prompts take "
                f"{', '.join(_THINKING_KEYS)} (bool) and reasoning_effort (str)"
            )
    return fields


def encode_prompt(prompt: str | Sequence[int], tokenizer, vocab_size: int) -> list[int]:
    """A prompt's token ids (text through `tokenizer`), each checked against the vocabulary."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError("this model has no tokenizer.json, so prompts must be token ids (--prompt-token-ids)")
        token_ids = tokenizer.encode(prompt)
    else:
        token_ids = [int(t) for t in prompt]
    if not token_ids:
        raise RequestError("the prompt is empty")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    return token_ids
