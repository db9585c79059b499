"""Fuzzing the request bodies of every body route of a live server (issue #14): no body, field value or body
size, however wrong, gets a 5xx or a hang.

Route by route (every body route of app.py; /v1/messages/count_tokens once the server has it):
- sizes: an empty or one-byte body is a 400; a body of exactly --max-request-body-mb is read, one byte
  more is a 413 (declared by Content-Length or chunked).
- field types: every field a route knows (fields.py's HONOURED and REFUSED, the protocol's own) gets a
  value of every JSON type; fields.py's get a 400 naming them.
- bodies: hypothesis builds them: valid requests with fields replaced by random JSON (wrong types, huge
  numbers, unicode, lone surrogates, nesting), random JSON objects, and random bytes.

Derandomized and bounded: a run is the same every time, the output length is always a cheap valid value or
an invalid one, and the whole module runs in about a minute. The HTTP layer (methods, paths, content types,
framing) is fuzzed in test_fuzz_http.py.
"""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer_core.serve.fields import HONOURED, REFUSED
from tests.serve.conftest import MODEL
from tests.serve.fuzz_support import (
    BODY_ROUTES,
    CHAT,
    COMPLETIONS,
    COUNT_TOKENS,
    DETOKENIZE,
    HI,
    MESSAGES,
    RESPONSES,
    TIMEOUT,
    TOKENIZE,
    VALID,
    assert_answered,
    assert_error_format,
    assert_healthy_after_fuzzing,
    dumps,
    require,
    send,
    served_paths,
)

FIELDS_ROUTE = {CHAT: "chat", RESPONSES: "responses", MESSAGES: "messages", COMPLETIONS: "completions"}  # fields.py's
BODY_LIMIT = 1 << 20  # the main server's --max-request-body-mb 1
EXAMPLES_PER_ROUTE = 50

FUZZ = settings(
    max_examples=EXAMPLES_PER_ROUTE,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

TRICKY_STRINGS = [
    "",
    " ",
    "\x00",
    "\ud800",  # a lone surrogate: not encodable as UTF-8
    "\udfff\ud800",
    "<｜User｜>",
    "<｜end▁of▁sentence｜>",
    "<think>",
    "</think>",
    "｜DSML｜",
    "\u202e\u0301\U0001f600",
    "é" * 300,
    MODEL,
    "system",
    "user",
    "assistant",
    "tool",
    "text",
    "image_url",
    "function",
    "auto",
    "none",
    "required",
    "json_object",
    "json_schema",
]
NUMBERS = [0, -1, 1, 2, 20, 21, 2**31, 2**32, 2**63, 2**64, -(2**63) - 1, 10**30, -(10**30), 0.5, -0.0, 1e308, -1e308]

texts = st.one_of(st.sampled_from(TRICKY_STRINGS), st.text(max_size=40))
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(NUMBERS),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    texts,
)
json_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(texts, st.sampled_from(TRICKY_STRINGS)), children, max_size=4),
    ),
    max_leaves=12,
)


def _costly(value) -> bool:
    """Would the server read this as a generation length worth many decoding steps?"""
    try:
        number = float(value) if not isinstance(value, (list, dict)) and value is not None else math.nan
    except (TypeError, ValueError, OverflowError):
        return False
    return 4 <= number <= 2048


def maybe(plausible):
    """Mostly a value of the right kind (edge values included), sometimes any JSON at all."""
    return st.one_of(plausible, plausible, plausible, json_values)


numbers = st.one_of(st.sampled_from(NUMBERS), st.floats(-3, 3), st.integers(-5, 30))
booleans = st.booleans()
stops = st.one_of(texts, st.lists(texts, max_size=3))

# the generation length: a cheap valid value, or an invalid one (never absent or null: that means "long")
max_tokens_values = st.one_of(st.integers(1, 3), json_values.filter(lambda v: v is not None and not _costly(v)))

content_parts = st.lists(
    st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "input_text", "output_text"]), "text": texts}),
        st.fixed_dictionaries({"type": st.sampled_from(["image_url", "image", "input_image", "file", "tool_result"])}),
        st.dictionaries(st.sampled_from(["type", "text", "image_url", "source", "cache_control"]), json_values),
    ),
    max_size=3,
)
contents = maybe(st.one_of(texts, texts, content_parts))
roles = st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer"]), texts)
messages = maybe(
    st.lists(
        st.one_of(
            st.fixed_dictionaries({"role": roles, "content": contents}),
            st.fixed_dictionaries({"role": st.just("user"), "content": contents}),
            st.dictionaries(st.sampled_from(["role", "content", "name", "tool_calls", "tool_call_id"]), json_values),
        ),
        max_size=4,
    )
)
tools = maybe(
    st.lists(
        st.one_of(
            st.fixed_dictionaries(
                {
                    "type": st.just("function"),
                    "function": st.fixed_dictionaries({"name": texts, "parameters": json_values}),
                }
            ),
            st.fixed_dictionaries({"type": st.just("function"), "name": texts, "parameters": json_values}),
            st.fixed_dictionaries({"name": texts, "input_schema": json_values}),
        ),
        max_size=2,
    )
)
tool_choices = maybe(
    st.one_of(
        st.sampled_from(["auto", "none", "required", "any"]),
        st.fixed_dictionaries({"type": st.sampled_from(["function", "tool", "auto"]), "name": texts}),
    )
)
formats = st.sampled_from(["text", "json_object", "json_schema", "regex"])
thinking = maybe(st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "auto"])}))
efforts = maybe(st.sampled_from(["low", "medium", "high", "xhigh", "max"]))

ROUTES = {
    CHAT: {
        "base": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0},
        "max": "max_tokens",
        "fields": {
            "messages": messages,
            "temperature": maybe(numbers),
            "top_p": maybe(numbers),
            "seed": maybe(numbers),
            "stop": maybe(stops),
            "logprobs": maybe(booleans),
            "top_logprobs": maybe(numbers),
            "n": maybe(numbers),
            "stream": maybe(booleans),
            "stream_options": maybe(st.fixed_dictionaries({"include_usage": booleans})),
            "tools": tools,
            "tool_choice": tool_choices,
            "response_format": maybe(st.fixed_dictionaries({"type": formats, "json_schema": json_values})),
            "thinking": thinking,
            "reasoning_effort": efforts,
            "frequency_penalty": maybe(numbers),
            "presence_penalty": maybe(numbers),
            "user": maybe(texts),
        },
    },
    RESPONSES: {
        "base": {"model": MODEL, "input": "hi", "temperature": 0},
        "max": "max_output_tokens",
        "fields": {
            "input": maybe(st.one_of(texts, messages)),
            "instructions": maybe(texts),
            "temperature": maybe(numbers),
            "top_p": maybe(numbers),
            "stream": maybe(booleans),
            "tools": tools,
            "tool_choice": tool_choices,
            "text": maybe(st.fixed_dictionaries({"format": st.fixed_dictionaries({"type": formats})})),
            "reasoning": maybe(st.fixed_dictionaries({"effort": efforts})),
            "include": maybe(st.lists(texts, max_size=2)),
            "previous_response_id": maybe(texts),
            "top_logprobs": maybe(numbers),
            "store": maybe(booleans),
        },
    },
    COMPLETIONS: {
        "base": {"model": MODEL, "prompt": "hi", "temperature": 0},
        "max": "max_tokens",
        "fields": {
            "prompt": maybe(
                st.one_of(texts, st.lists(st.integers(-2, 200_000), max_size=5), st.lists(texts, max_size=2))
            ),
            "temperature": maybe(numbers),
            "top_p": maybe(numbers),
            "top_k": maybe(numbers),
            "min_p": maybe(numbers),
            "seed": maybe(numbers),
            "stop": maybe(stops),
            "logprobs": maybe(numbers),
            "echo": maybe(booleans),
            "n": maybe(numbers),
            "stream": maybe(booleans),
            "stream_options": maybe(st.fixed_dictionaries({"include_usage": booleans})),
            "presence_penalty": maybe(numbers),
            "frequency_penalty": maybe(numbers),
        },
    },
    MESSAGES: {
        "base": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0},
        "max": "max_tokens",
        "fields": {
            "messages": messages,
            "system": maybe(st.one_of(texts, content_parts)),
            "temperature": maybe(numbers),
            "top_p": maybe(numbers),
            "top_k": maybe(numbers),
            "stop_sequences": maybe(st.lists(texts, max_size=3)),
            "stream": maybe(booleans),
            "tools": tools,
            "tool_choice": tool_choices,
            "thinking": thinking,
            "metadata": maybe(st.fixed_dictionaries({"user_id": texts})),
        },
    },
    COUNT_TOKENS: {
        "base": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        "max": None,
        "fields": {
            "messages": messages,
            "system": maybe(st.one_of(texts, content_parts)),
            "tools": tools,
            "tool_choice": tool_choices,
            "thinking": thinking,
        },
    },
    TOKENIZE: {
        "base": {"model": MODEL, "prompt": "hi"},
        "max": None,
        "fields": {
            "prompt": maybe(texts),
            "messages": messages,
            "add_generation_prompt": maybe(booleans),
            "add_special_tokens": maybe(booleans),
            "continue_final_message": maybe(booleans),
            "return_token_strs": maybe(booleans),
            "tools": tools,
        },
    },
    DETOKENIZE: {
        "base": {"model": MODEL, "tokens": [1, 2]},
        "max": None,
        "fields": {
            "tokens": maybe(st.lists(st.one_of(st.integers(-2, 200_000), st.sampled_from(NUMBERS)), max_size=5))
        },
    },
}


@st.composite
def bodies(draw, path: str) -> bytes:
    route, length = ROUTES[path], ROUTES[path]["max"]
    kind = draw(st.sampled_from(["mutated", "mutated", "mutated", "object", "bytes"]))
    if kind == "bytes":
        return draw(st.one_of(st.binary(max_size=64), st.sampled_from([b"{", b"[]", b"null", b"1e999", b"\xff"])))
    if kind == "object":
        body = draw(st.dictionaries(st.one_of(texts, st.sampled_from(list(route["fields"]))), json_values, max_size=5))
        if length and (_costly(body.get(length)) or body.get(length) is None):
            body[length] = 1
    else:
        body = dict(route["base"])
        names = draw(st.lists(st.sampled_from(sorted(route["fields"])), min_size=1, max_size=3, unique=True))
        for name in names:
            if draw(st.integers(0, 5)) == 0:
                body.pop(name, None)
            else:
                body[name] = draw(route["fields"][name])
        if draw(st.integers(0, 5)) == 0:
            body["model"] = draw(st.one_of(texts, json_values))
        if length:
            body[length] = draw(max_tokens_values)
    return dumps(body)


@pytest.fixture(scope="module")
def served(http) -> set[str]:
    return served_paths(http)


# ---- bodies (hypothesis) ------------------------------------------------------------------------------------

STATUSES: Counter[int] = Counter()  # what the fuzzing got, to check that it reached both answers and refusals


@pytest.mark.parametrize("path", list(ROUTES))
def test_no_body_gets_a_server_error(http, served, path):
    require(path, served)

    @FUZZ
    @given(raw=bodies(path))
    def run(raw: bytes) -> None:
        r, payload = send(http, "POST", path, raw, content_type="application/json")
        STATUSES[r.status_code] += 1
        assert_answered(path, r, payload, raw[:500])

    run()


# ---- sizes --------------------------------------------------------------------------------------------------

ONE_BYTE_BODIES = [b"{", b"}", b"[", b"1", b"n", b'"', b" ", b"\x00", b"\xff"]


def padded(path: str, size: int) -> bytes:
    """The route's valid body, padded with spaces to `size` bytes."""
    raw = dumps(VALID[path])
    return raw[:-1] + b" " * (size - len(raw)) + b"}"


@pytest.mark.parametrize("path", BODY_ROUTES)
def test_empty_and_one_byte_bodies_are_400(http, served, path):
    require(path, served)
    for raw in [b"", *ONE_BYTE_BODIES]:
        r, payload = send(http, "POST", path, raw, content_type="application/json")
        assert r.status_code == 400, (path, raw, r.status_code, payload[:300])
        assert_error_format(path, payload)


@pytest.mark.parametrize("path", BODY_ROUTES)
def test_a_body_at_the_limit_is_read_and_one_byte_more_is_413(http, served, path):
    require(path, served)
    r, payload = send(http, "POST", path, padded(path, BODY_LIMIT), content_type="application/json")
    assert r.status_code == 200, (path, r.status_code, payload[:300])
    over = padded(path, BODY_LIMIT + 1)
    r, payload = send(http, "POST", path, over, content_type="application/json")  # declared: Content-Length
    assert r.status_code == 413, (path, r.status_code, payload[:300])
    assert_error_format(path, payload)
    chunks = (over[i : i + (64 << 10)] for i in range(0, len(over), 64 << 10))  # no Content-Length: chunked
    with http.stream("POST", path, content=chunks, headers={"content-type": "application/json"}, timeout=TIMEOUT) as r:
        payload = r.read()
    assert r.status_code == 413, (path, r.status_code, payload[:300])
    assert_error_format(path, payload)


# ---- field types --------------------------------------------------------------------------------------------

DEEP = json.loads("[" * 200 + "]" * 200)  # deeper than deepseek-recipe's parser goes
WRONG_TYPES = [
    None, True, False, 0, -1, 1.5, -0.5, 10**30, -(10**30), math.nan, math.inf, "", "x", "NaN", "-Infinity", "1e999",
    [], [None, 1, "a"], {}, {"type": {"type": None}}, DEEP,
]  # fmt: skip
LENGTH_FIELDS = {"max_tokens", "max_completion_tokens", "max_output_tokens"}  # null: as long as the context allows
PROTOCOL_FIELDS = {  # each protocol's request fields (OpenAI's, Anthropic's, vLLM's); fields.py's are added
    CHAT: [
        "model", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options", "stop", "logprobs",
        "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "response_format", "reasoning_effort",
        "thinking", "user", "metadata", "store", "service_tier", "functions", "function_call", "modalities",
        "prediction", "web_search_options", "chat_template_kwargs", "return_tokens_as_token_ids",
    ],
    RESPONSES: [
        "model", "input", "instructions", "max_output_tokens", "stream", "stream_options", "tools", "tool_choice",
        "parallel_tool_calls", "text", "reasoning", "include", "previous_response_id", "store", "metadata", "user",
        "top_logprobs", "truncation", "background", "service_tier", "max_tool_calls", "prompt", "conversation",
    ],
    MESSAGES: [
        "model", "messages", "max_tokens", "system", "stop_sequences", "stream", "tools", "tool_choice", "thinking",
        "metadata", "service_tier", "container", "mcp_servers", "context_management",
    ],
    COUNT_TOKENS: ["model", "messages", "system", "tools", "tool_choice", "thinking", "mcp_servers"],
    COMPLETIONS: [
        "model", "prompt", "suffix", "max_tokens", "stream", "stream_options", "logprobs", "echo", "stop", "user",
        "logit_bias", "return_tokens_as_token_ids",
    ],
    TOKENIZE: ["model", "prompt", "add_special_tokens", "continue_final_message", "return_token_strs"],
    DETOKENIZE: ["model", "tokens"],
}  # fmt: skip
TOKENIZE_FLAGS = ["add_generation_prompt", "add_special_tokens", "continue_final_message", "return_token_strs"]
TOKENIZE_MESSAGES = ["model", "messages", *TOKENIZE_FLAGS, "tools", "tool_choice", "thinking", "chat_template_kwargs"]


def known_fields(path: str) -> list[str]:
    route = FIELDS_ROUTE.get(path)
    return sorted({*PROTOCOL_FIELDS[path], *HONOURED.get(route, ()), *REFUSED.get(route, {})})


@pytest.mark.parametrize(
    ("path", "base", "names"),
    [pytest.param(path, VALID[path], known_fields(path), id=path) for path in BODY_ROUTES]
    + [pytest.param(TOKENIZE, {"model": MODEL, "messages": HI}, TOKENIZE_MESSAGES, id="/tokenize(messages)")],
)
def test_no_field_of_any_type_gets_a_server_error(http, served, path, base, names):
    require(path, served)
    for name in names:
        for value in WRONG_TYPES:
            if value is None and name in LENGTH_FIELDS:
                continue
            raw = dumps({**base, name: value})
            r, payload = send(http, "POST", path, raw, content_type="application/json")
            assert_answered(path, r, payload, raw[:300])


NO_VALID_TYPE = [{}, {"a": [1]}, [[1]], -(10**30), math.nan]  # what no sampling field takes


@pytest.mark.parametrize("path", list(FIELDS_ROUTE))
def test_sampling_and_refused_fields_of_a_wrong_type_are_400_naming_them(http, path):
    """fields.py's promise: a sampling field a route honours, or a field it refuses, given a value it cannot
    take is a 400 naming the field (in `param`; in the message for Anthropic's format, which has no param)."""
    route = FIELDS_ROUTE[path]
    cases = [(name, value, name) for name in HONOURED[route] for value in NO_VALID_TYPE]
    cases += [
        (name, value, refusal.param or name)
        for name, refusal in REFUSED[route].items()
        for value in [*NO_VALID_TYPE, "x", True, 7]
        if not refusal.harmless(value)
    ]
    for name, value, param in cases:
        r, payload = send(http, "POST", path, dumps({**VALID[path], name: value}), content_type="application/json")
        assert r.status_code == 400, (path, name, value, r.status_code, payload[:300])
        error = assert_error_format(path, payload)
        assert param in error["message"] if path.startswith(MESSAGES) else error["param"] == param, (name, error)


def test_tokenizer_fields_of_a_wrong_type_are_400_naming_them(http):
    tokens = ("1", 1, None, {}, [1.5], [True], [[1]], [-1], [10**30])
    cases = [
        *(
            ({"messages": HI, flag: value}, TOKENIZE, flag)
            for flag in TOKENIZE_FLAGS
            for value in ("true", 1, 0, [], {})
        ),
        *(({"prompt": value}, TOKENIZE, "prompt") for value in (None, 1, True, 1.5, {})),
        *(({"tokens": value}, DETOKENIZE, "tokens") for value in tokens),
    ]
    for body, path, param in cases:
        r, payload = send(http, "POST", path, dumps({"model": MODEL, **body}), content_type="application/json")
        assert r.status_code == 400, (path, body, r.status_code, payload[:300])
        assert assert_error_format(path, payload)["param"] == param, (body, payload[:300])


# ---- last -----------------------------------------------------------------------------------------------------


def test_server_healthy_after_fuzzing(server, http):
    if STATUSES:  # the fuzzing ran in this session: it must have produced generations as well as refusals
        assert STATUSES[200] >= 10 and sum(n for status, n in STATUSES.items() if 400 <= status < 500) >= 50, STATUSES
    assert_healthy_after_fuzzing(server, http)
