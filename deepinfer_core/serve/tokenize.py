"""vLLM's `/tokenize` and `/detokenize`, and Anthropic's `/v1/messages/count_tokens`: what the server would
feed the model, without running it.

/tokenize takes {model?, prompt} (encoded as /v1/completions encodes it) or {model?, messages,
add_generation_prompt?} (the DeepSeek chat encoding of /v1/chat/completions) and answers
{"count", "max_model_len", "tokens", "token_strs"}; /detokenize takes {model?, tokens} and answers
{"prompt": text}; count_tokens takes a /v1/messages body (max_tokens not needed) and answers
{"input_tokens": the prompt tokens /v1/messages would count}. Prompts are encoded in a worker thread
(prompt_encoding.py says why); a prompt longer than the context is counted, not refused (as in vLLM).
"""

from __future__ import annotations

import asyncio
import json

import deepseek_recipe as dr

from deepinfer_core.serve.errors import ApiError, from_conversion_error, invalid_body
from deepinfer_core.serve.protocols import PROTOCOLS, encode_prompt, parse_request
from deepinfer_core.serve.state import ServerState

__all__ = ["run_count_tokens", "run_detokenize", "run_tokenize"]

# fields of vLLM's tokenize request that are ours to read, not the chat converter's
_TOKENIZE_ONLY = ("add_generation_prompt", "continue_final_message", "add_special_tokens", "return_token_strs")
# the prompt the chat encoding appends for the model's answer: <｜Assistant｜>, then <think> or </think>
_ANSWER_START = dr.SpecialToken.Assistant.default_str()
_THINKING = (dr.SpecialToken.ThinkingStart.default_str(), dr.SpecialToken.ThinkingEnd.default_str())


def _check_model(state: ServerState, body: dict) -> None:
    model = body.get("model")
    if model is not None and model != state.served_model_name:
        raise ApiError(
            404,
            f"The model `{model}` does not exist; this server serves `{state.served_model_name}`.",
            param="model",
            code="model_not_found",
        )


def _flag(body: dict, field: str, default: bool) -> bool:
    value = body.get(field, default)
    if not isinstance(value, bool):
        raise ApiError(400, f"invalid value for {field}: expected true or false, got {value!r}", param=field)
    return value


def _chat_tokens(state: ServerState, body: dict) -> list[int]:
    """The chat route's encoding of `messages` (deepseek-recipe), with or without the answer prompt."""
    # the encoding places its own special tokens; vLLM's options to add more or to continue the last
    # message have no DeepSeek encoding here: refused by name rather than ignored
    for field in ("add_special_tokens", "continue_final_message"):
        if _flag(body, field, False):
            raise ApiError(400, f"{field}=true is not supported with messages on this server", param=field)
    chat = {k: v for k, v in body.items() if k not in _TOKENIZE_ONLY}
    chat["model"] = state.served_model_name
    try:
        conversation = dr.ChatCompletionRequest(chat).convert(state.options).conversation
        ids = list(state.encoding.encode(conversation))
    except dr.ConversionError as err:
        raise from_conversion_error(err) from None
    except (ValueError, TypeError, OverflowError, RecursionError) as err:
        raise invalid_body(err) from None
    if _flag(body, "add_generation_prompt", True):
        return ids
    answer_start = state.recipe_tokenizer.encode(_ANSWER_START)
    thinking = {t for spelling in _THINKING for t in state.recipe_tokenizer.encode(spelling)}
    if len(answer_start) == 1 and answer_start[0] in ids:
        cut = len(ids) - 1 - ids[::-1].index(answer_start[0])
        if all(t in thinking for t in ids[cut + 1 :]):
            return ids[:cut]
    return ids


def _prompt_tokens(state: ServerState, body: dict) -> list[int]:
    prompt = body["prompt"]
    if not isinstance(prompt, str):
        raise ApiError(400, "invalid value for prompt: expected a string", param="prompt")
    if _flag(body, "continue_final_message", False):
        raise ApiError(400, "continue_final_message applies to messages, not to prompt", param="continue_final_message")
    return state.tokenizer.encode_many([prompt], add_special_tokens=_flag(body, "add_special_tokens", True))[0]


def _token_strs(state: ServerState, tokens: list[int]) -> list[str]:
    """Each token's vocabulary entry (vLLM's convert_ids_to_tokens)."""
    return state.tokenizer.convert_ids_to_tokens(tokens)


def _tokenize(state: ServerState, body: dict) -> str:
    _check_model(state, body)
    if ("messages" in body) == ("prompt" in body):
        raise ApiError(400, "give either prompt (text) or messages (a conversation), not both and not neither")
    tokens = _chat_tokens(state, body) if "messages" in body else _prompt_tokens(state, body)
    answer = {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens, "token_strs": None}
    if _flag(body, "return_token_strs", False):
        answer["token_strs"] = _token_strs(state, tokens)
    return json.dumps(answer)


async def run_tokenize(state: ServerState, body: dict):
    return "json", await asyncio.to_thread(_tokenize, state, body)


def _count_tokens(state: ServerState, body: dict) -> str:
    protocol = PROTOCOLS["messages"]
    _, prompt_ids = encode_prompt(state, protocol, parse_request(state, protocol, body), must_fit=False)
    return json.dumps({"input_tokens": len(prompt_ids)})


async def run_count_tokens(state: ServerState, body: dict):
    """Anthropic's count_tokens: -> ("json", {"input_tokens": N}). Raises ApiError (in Anthropic's format
    on a path under /v1/messages)."""
    return "json", await asyncio.to_thread(_count_tokens, state, body)


async def run_detokenize(state: ServerState, body: dict):
    _check_model(state, body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in tokens):
        raise ApiError(400, "invalid value for tokens: expected a list of token ids (integers)", param="tokens")
    vocab = state.tokenizer.vocab_size
    if bad := [t for t in tokens if not 0 <= t < vocab]:
        raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="tokens")
    text = state.tokenizer.decode(tokens, skip_special_tokens=False)  # vLLM keeps them
    return "json", json.dumps({"prompt": text})
