"""Property-based fuzzing of the POST routes: no request body, however wrong, gets a 5xx.

The server's OpenAPI schema (/openapi.json) declares no request bodies (every route reads the raw body
itself), so a schema-driven fuzzer such as schemathesis would have nothing to generate from. Instead,
hypothesis builds bodies for each route: valid requests with fields replaced by random JSON (wrong types,
huge numbers, unicode, lone surrogates, nesting), random JSON objects, and random bytes. Every answer must
be below 500 and, when it is an error, in the route's protocol format. Derandomized and bounded, so a run
is the same every time and stays within a few seconds.

The length of what is generated is kept small (the max-tokens field is always a cheap valid value or an
invalid one), so valid bodies cost a few decoding steps each.
"""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MODEL = "deepinfer-demo-deepseek-v4-random"
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
COMPLETIONS = "/v1/completions"
MESSAGES = "/v1/messages"
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
}


@st.composite
def bodies(draw, path: str) -> bytes:
    route = ROUTES[path]
    kind = draw(st.sampled_from(["mutated", "mutated", "mutated", "object", "bytes"]))
    if kind == "bytes":
        return draw(st.one_of(st.binary(max_size=64), st.sampled_from([b"{", b"[]", b"null", b"1e999", b"\xff"])))
    if kind == "object":
        body = draw(st.dictionaries(st.one_of(texts, st.sampled_from(list(route["fields"]))), json_values, max_size=5))
        body.setdefault(route["max"], 1)
        if _costly(body.get(route["max"])) or body.get(route["max"]) is None:
            body[route["max"]] = 1
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
        body[route["max"]] = draw(max_tokens_values)
    try:
        return json.dumps(body).encode()
    except (ValueError, UnicodeEncodeError):
        return json.dumps(body, ensure_ascii=True).encode()


STATUSES: Counter[int] = Counter()  # what the fuzzing got, to check that it reached both answers and refusals


def check_answer(http, path: str, raw: bytes) -> None:
    with http.stream("POST", path, content=raw, headers={"content-type": "application/json"}, timeout=60) as r:
        payload = r.read()
    STATUSES[r.status_code] += 1
    assert r.status_code < 500, (r.status_code, raw[:500], payload[:500])
    if r.status_code >= 400:
        error = json.loads(payload)
        if path == MESSAGES:
            assert error["type"] == "error" and isinstance(error["error"]["message"], str), error
        else:
            assert isinstance(error["error"]["message"], str) and "type" in error["error"], error
    else:
        assert r.status_code == 200


@pytest.mark.parametrize("path", list(ROUTES))
def test_no_body_gets_a_server_error(http, path):
    @FUZZ
    @given(raw=bodies(path))
    def run(raw: bytes) -> None:
        check_answer(http, path, raw)

    run()


def test_server_healthy_after_fuzzing(server, http):
    if STATUSES:  # the fuzzing ran in this session: it must have produced generations as well as refusals
        assert STATUSES[200] >= 10 and sum(n for status, n in STATUSES.items() if 400 <= status < 500) >= 50, STATUSES
    assert http.get("/health").json() == {"status": "ok"}
    assert server.server_errors() == {}
    assert server.wait_idle() == (0, 0, 0)
    server.assert_no_tracebacks()
