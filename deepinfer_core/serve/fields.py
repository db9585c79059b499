"""Which request-body fields each route honours or refuses, and how they become SamplingParams.

Every sampling field a route accepts reaches the sampler; a sampling field we cannot honour is a 400
naming it, never silently ignored. So is a feature the server does not have (Responses' stored state,
background runs). Other fields that do not touch sampling (user, metadata, service_tier,
parallel_tool_calls, ...) are accepted. Stop strings and stop token ids have one limit on every route
(`MAX_STOP_STRINGS`, `MAX_STOP_STRING_CHARS`, `MAX_STOP_TOKEN_IDS`). tool_choice is checked in
tool_choice.py.

Routes: "chat" (/v1/chat/completions), "responses" (/v1/responses), "messages" (/v1/messages),
"completions" (/v1/completions). Public API (stable): `refuse_unsupported`, `check_sampling_fields`,
`requested_max_tokens`, `resolve_max_tokens`, `sampling_params_from_body`, `HONOURED`, `REFUSED`,
the `MAX_STOP_*` limits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.serve.errors import ApiError
from deepinfer_core.serve.structured_fields import structured_outputs_from_body

__all__ = [
    "HONOURED",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_CHARS",
    "MAX_STOP_TOKEN_IDS",
    "REFUSED",
    "Refusal",
    "check_sampling_fields",
    "refuse_unsupported",
    "requested_max_tokens",
    "resolve_max_tokens",
    "sampling_params_from_body",
]

ROUTES = ("chat", "responses", "messages", "completions")

# Limits on what stops a request, the same on every route. The engine looks for every stop string at every
# step, and works out how much of the text may still become one in time quadratic in a stop string's
# length; it tests every generated token against the stop token ids. 16 stop strings is deepseek-recipe's
# limit on chat and messages (OpenAI allows 4); 1024 stop token ids is far more than a stop list needs.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024


# --- value checks: each returns the value or raises ApiError naming the field ------------------------


def _bad(field: str, expected: str, value: Any) -> ApiError:
    return ApiError(400, f"invalid value for {field}: expected {expected}, got {value!r}", param=field)


def _number(field: str, value: Any, low: float, high: float, *, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(field, "a number", value)
    ok_low = value > low if low_open else value >= low
    if not (ok_low and value <= high) or value != value:  # NaN compares false everywhere
        bracket = "(" if low_open else "["
        raise _bad(field, f"a number in {bracket}{low:g}, {high:g}]", value)
    return float(value)


def _integer(field: str, value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(field, "an integer", value)
    if value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise _bad(field, f"an integer {span}", value)
    return value


def _boolean(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _bad(field, "true or false", value)
    return value


def _too_many(field: str, count: int, limit: int, what: str) -> ApiError:
    message = f"invalid value for {field}: at most {limit} {what} are allowed, got {count}"
    return ApiError(400, message, param=field)


def _stop_token_ids(field: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise _bad(field, "a list of token ids (non-negative integers)", value)
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise _too_many(field, len(value), MAX_STOP_TOKEN_IDS, "stop token ids")
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in value):
        raise _bad(field, "a list of token ids (non-negative integers)", value)
    return tuple(value)


def _stop(field: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise _bad(field, "a non-empty string or a list of non-empty strings", value)
    if len(value) > MAX_STOP_STRINGS:
        raise _too_many(field, len(value), MAX_STOP_STRINGS, "stop strings")
    if not all(isinstance(s, str) and s for s in value):
        raise _bad(field, "a non-empty string or a list of non-empty strings", value)
    if longest := max((len(s) for s in value if len(s) > MAX_STOP_STRING_CHARS), default=0):
        message = (
            f"invalid value for {field}: a stop string may be at most {MAX_STOP_STRING_CHARS} characters long, "
            f"got one of {longest}"
        )
        raise ApiError(400, message, param=field)
    return tuple(value)


# field in the body -> (SamplingParams attribute, check). vLLM's names and ranges.
_Check = Callable[[str, Any], Any]
_SAMPLING: dict[str, tuple[str, _Check]] = {
    "temperature": ("temperature", lambda f, v: _number(f, v, 0, 2)),
    "top_p": ("top_p", lambda f, v: _number(f, v, 0, 1, low_open=True)),
    "top_k": ("top_k", lambda f, v: _integer(f, v, -1, 2**31 - 1)),
    "min_p": ("min_p", lambda f, v: _number(f, v, 0, 1)),
    "repetition_penalty": ("repetition_penalty", lambda f, v: _number(f, v, 0, float("inf"), low_open=True)),
    "presence_penalty": ("presence_penalty", lambda f, v: _number(f, v, -2, 2)),
    "frequency_penalty": ("frequency_penalty", lambda f, v: _number(f, v, -2, 2)),
    "seed": ("seed", lambda f, v: _integer(f, v, 0, 2**64 - 1)),
    "min_tokens": ("min_tokens", lambda f, v: _integer(f, v, 0, 2**31 - 1)),
    "stop_token_ids": ("stop_token_ids", _stop_token_ids),
    "ignore_eos": ("ignore_eos", _boolean),
    "skip_special_tokens": ("skip_special_tokens", _boolean),
    "n": ("n", lambda f, v: _integer(f, v, 1, 128)),
    "best_of": ("best_of", lambda f, v: _integer(f, v, 1, 128)),
    "stop": ("stop", _stop),
    "stop_sequences": ("stop", _stop),  # Anthropic's spelling
    "logprobs": ("logprobs", lambda f, v: _integer(f, v, 0, 20)),  # Completions' integer form
    "prompt_logprobs": ("prompt_logprobs", lambda f, v: _integer(f, v, 0, 20)),
}

_EXTRAS = (  # vLLM's extra sampling parameters, on every route
    "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos",
    "skip_special_tokens", "seed",
)  # fmt: skip

# Sampling fields each route reads from the raw body (fields the protocol converter reads itself, such as
# chat's logprobs/top_logprobs/stop, are passed to sampling_params_from_body as keyword overrides).
# Responses' stop is vLLM's extra: the recipe does not read it.
HONOURED: dict[str, tuple[str, ...]] = {
    "chat": ("temperature", "top_p", "presence_penalty", "frequency_penalty", "n", *_EXTRAS),
    "responses": ("temperature", "top_p", "presence_penalty", "frequency_penalty", "stop", *_EXTRAS),
    "messages": ("temperature", "top_p", "presence_penalty", "frequency_penalty", *_EXTRAS),
    "completions": (
        "temperature", "top_p", "presence_penalty", "frequency_penalty", "n", "best_of", "stop", "logprobs",
        "prompt_logprobs", *_EXTRAS,
    ),
}  # fmt: skip
# Sampling fields the protocol converter reads itself, checked here first: the same limits on every route
_CONVERTED: dict[str, tuple[str, ...]] = {"chat": ("stop",), "messages": ("stop_sequences",)}


# --- refused fields: asked for (not absent and not a no-op value), they are a 400 -------------------------


@dataclass(frozen=True, slots=True)
class Refusal:
    harmless: Callable[[Any], bool]  # values that ask for nothing (absent, false, empty)
    advice: str  # why, and what to do instead
    param: str | None = None  # the name to report when it is not the field's (a nested field)


def _absent(value: Any) -> bool:
    return value is None


def _false(value: Any) -> bool:
    return value is None or value is False


def _empty(value: Any) -> bool:
    return value is None or value == {} or value == []


def _one(value: Any) -> bool:
    return value is None or (value == 1 and not isinstance(value, bool))


_GUIDED = (
    'the guided_* fields are vLLM\'s older spelling; send structured_outputs ({"json": SCHEMA}, {"regex": ...}, '
    '{"choice": [...]}, {"grammar": ...}) or response_format instead'
)
_FORMAT_FIELD = "structured_outputs is vLLM's field for chat and completions; this protocol's is {field}"
_GUIDED_FIELDS = (
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "guided_whitespace_pattern",
)  # fmt: skip
_COMMON = {
    **{name: Refusal(_absent, _GUIDED) for name in _GUIDED_FIELDS},
    "logit_bias": Refusal(_empty, "logit_bias is not supported; leave it out"),
    "allowed_token_ids": Refusal(_absent, "allowed_token_ids is not supported; leave it out"),
    "bad_words": Refusal(_empty, "bad_words is not supported; leave it out"),
    "logits_processors": Refusal(_empty, "logits_processors is not supported; leave it out"),
    "use_beam_search": Refusal(_false, "beam search is not supported; sample several answers with n instead"),
    "length_penalty": Refusal(_absent, "length_penalty only applies to beam search, which is not supported"),
    "include_stop_str_in_output": Refusal(_false, "include_stop_str_in_output is not supported; leave it out"),
    "truncate_prompt_tokens": Refusal(_absent, "truncate_prompt_tokens is not supported; shorten the prompt"),
    "spaces_between_special_tokens": Refusal(_absent, "spaces_between_special_tokens is not supported"),
}
_STATELESS = "this server stores nothing between requests"
_NOT_ON_CHAT = "is not available on chat completions (as in vLLM); use /v1/completions"
_ONE_ANSWER = "this protocol returns one answer: n must be 1 or absent"
REFUSED: dict[str, dict[str, Refusal]] = {
    "chat": {
        **_COMMON,
        "best_of": Refusal(_absent, f"best_of {_NOT_ON_CHAT}"),
        "prompt_logprobs": Refusal(_absent, f"prompt_logprobs {_NOT_ON_CHAT}"),
        "echo": Refusal(_false, "echo is not supported on chat completions; leave it out"),
    },
    "responses": {
        **_COMMON,
        "n": Refusal(_one, _ONE_ANSWER),
        "best_of": Refusal(_absent, "best_of is not available here; use /v1/completions"),
        "prompt_logprobs": Refusal(_absent, "prompt_logprobs is not available here; use /v1/completions"),
        "structured_outputs": Refusal(_absent, _FORMAT_FIELD.format(field="text.format")),
        "previous_response_id": Refusal(_absent, f"{_STATELESS}; send the whole conversation in input"),
        "conversation": Refusal(_absent, f"{_STATELESS}; send the whole conversation in input"),
        "store": Refusal(_false, f"{_STATELESS}; leave store out or set it to false"),
        "background": Refusal(_false, f"background runs need stored responses and {_STATELESS}; leave it out"),
    },
    "messages": {
        **_COMMON,
        "n": Refusal(_one, _ONE_ANSWER),
        "best_of": Refusal(_absent, "best_of is not available here; use /v1/completions"),
        "prompt_logprobs": Refusal(_absent, "prompt_logprobs is not available here; use /v1/completions"),
        "structured_outputs": Refusal(_absent, _FORMAT_FIELD.format(field="output_config.format")),
    },
    "completions": {
        **_COMMON,
        "suffix": Refusal(lambda v: not v, "suffix (insertion) is not supported; put all the text in prompt"),
    },
}
# a request's output constraint (deepseek-recipe's OutputConstraint.kind) that only structured outputs can
# enforce, and the field that asked for it: refused if structured_fields.py did not read one from the body (a
# safety net: it reads every route's); tool-call constraints become tool-call grammars (structured_fields.py)
CONSTRAINT_FIELDS = {"chat": "response_format", "responses": "text.format", "messages": "output_config.format"}
GUIDED_CONSTRAINTS = ("json", "regex")


def _route(route: str) -> str:
    if route not in ROUTES:
        raise ValueError(f"unknown route {route!r}; expected one of {ROUTES}")
    return route


def refuse_unsupported(body: dict, route: str) -> None:
    """Raise a 400 naming the first field of `body` that asks for something this server cannot do."""
    for field, refusal in REFUSED[_route(route)].items():
        if field in body and not refusal.harmless(body[field]):
            param = refusal.param or field
            raise ApiError(400, f"unsupported parameter {param}: {refusal.advice}", param=param)


def check_sampling_fields(body: dict, route: str) -> None:
    """Raise a 400 naming the first sampling field `route` takes whose value is of the wrong type or range
    (or past the stop limits)."""
    for field in (*HONOURED[_route(route)], *_CONVERTED.get(route, ())):
        if body.get(field) is not None:
            _SAMPLING[field][1](field, body[field])


# --- the output length --------------------------------------------------------------------------------

_LENGTH_FIELDS = {
    "chat": ("max_completion_tokens", "max_tokens"),  # the first given wins (vLLM's rule)
    "responses": ("max_output_tokens",),
    "messages": ("max_tokens",),
    "completions": ("max_tokens",),
}


def requested_max_tokens(body: dict, route: str, *, max_model_len: int | None = None) -> tuple[int | None, str]:
    """(the output length the body asks for, or None; the field that asked). Chat: max_completion_tokens
    (OpenAI's current name) wins over the deprecated max_tokens when both are given, as in vLLM.
    Messages: max_tokens is required, as in Anthropic's API. With `max_model_len`, a length that cannot
    fit the context whatever the prompt is a 400 already (before the prompt is encoded)."""
    names = _LENGTH_FIELDS[_route(route)]
    for name in names:
        if body.get(name) is not None:
            asked = _integer(name, body[name], 1)
            if max_model_len is not None and asked >= max_model_len:
                message = (
                    f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                    f"{asked} output tokens ({name}), which leaves no room for the prompt. Lower {name}."
                )
                raise ApiError(400, message, param=name)
            return asked, name
    if route == "messages":
        message = "max_tokens: field required (the Messages API needs an output limit)"
        raise ApiError(400, message, param="max_tokens")
    return None, names[0]


def resolve_max_tokens(
    requested: int | None,
    field: str,
    *,
    prompt_len: int,
    max_model_len: int,
    default_max_tokens: int | None,
) -> int:
    """The output limit to run with: the request's, else `default_max_tokens`; never past the context.
    A request asking for more than the context leaves is a 400, as in vLLM."""
    room = max_model_len - prompt_len
    if requested is not None and requested > room or room < 1:
        asked = requested if requested is not None else 1
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + asked} tokens ({prompt_len} in the prompt, {asked} in the completion). "
            f"Please reduce the length of the prompt or of {field}.",
            param=field,
        )
    if requested is not None:
        return requested
    return room if default_max_tokens is None else min(default_max_tokens, room)


# --- SamplingParams --------------------------------------------------------------------------------------


def sampling_params_from_body(body: dict, *, route: str, max_tokens: int, **given: Any) -> SamplingParams:
    """SamplingParams from the sampling fields `route` honours in `body` (each checked, a 400 naming the
    field when bad). `given`: SamplingParams attributes the route already parsed (e.g. chat's stop and
    logprobs from the protocol converter); None values are ignored, the others win over the body."""
    given = {k: v for k, v in given.items() if v is not None}
    values: dict[str, Any] = {}
    for field in HONOURED[_route(route)]:
        attribute, check = _SAMPLING[field]
        if body.get(field) is not None and attribute not in given:
            values[attribute] = check(field, body[field])
    values.update(given)
    if (structured := structured_outputs_from_body(body, route)) is not None:
        values["structured_outputs"] = structured
    min_tokens = values.get("min_tokens", 0)
    if min_tokens > max_tokens:
        message = f"min_tokens ({min_tokens}) must not exceed the output limit ({max_tokens})"
        raise ApiError(400, message, param="min_tokens")
    if values.get("best_of") is not None and values["best_of"] < values.get("n", 1):
        message = f"best_of ({values['best_of']}) must be >= n ({values.get('n', 1)})"
        raise ApiError(400, message, param="best_of")
    try:
        return SamplingParams(max_tokens=max_tokens, **values)
    except ValueError as err:  # what the per-field checks let through
        raise ApiError(400, str(err)) from None
