"""What one request may ask, on every route, against live servers: stop lists and stop token ids within
fields.py's limits, prompts that cannot fit the context refused before they are encoded, encoding that
never stalls other clients, Responses features this stateless server lacks refused by name, tool_choice
checked against tools, and Anthropic's count_tokens counting what /v1/messages feeds the model.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from deepinfer_core.serve import fields

MODEL = "deepinfer-demo-deepseek-v4-random"
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
COMPLETIONS = "/v1/completions"
MESSAGES = "/v1/messages"
ROUTES = [CHAT, RESPONSES, COMPLETIONS, MESSAGES]
USER = [{"role": "user", "content": "hi"}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
RESPONSES_TOOLS = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]
MESSAGES_TOOLS = [{"name": "f", "input_schema": {"type": "object", "properties": {}}}]


def body_for(path: str, **overrides) -> dict:
    body = {
        CHAT: {"model": MODEL, "messages": USER, "max_tokens": 2},
        RESPONSES: {"model": MODEL, "input": "hi", "max_output_tokens": 2},
        COMPLETIONS: {"model": MODEL, "prompt": "hi", "max_tokens": 2},
        MESSAGES: {"model": MODEL, "messages": USER, "max_tokens": 2},
    }[path]
    return {**body, "temperature": 0, **overrides}


def with_prompt(path: str, text: str, **overrides) -> dict:
    """A body whose prompt is `text`."""
    prompt = {"input": text} if path == RESPONSES else {"prompt": text} if path == COMPLETIONS else None
    return body_for(path, **(prompt or {"messages": [{"role": "user", "content": text}]}), **overrides)


def error(response: httpx.Response, path: str) -> tuple[str, str | None]:
    """(message, param) of a 400 in the route's protocol; Anthropic's errors name no param."""
    assert response.status_code == 400, (response.status_code, response.text)
    body = response.json()
    if path.startswith(MESSAGES):
        return body["error"]["message"], None
    return body["error"]["message"], body["error"]["param"]


def stop_field(path: str) -> str:
    return "stop_sequences" if path == MESSAGES else "stop"


# ---- stop strings and stop token ids: one limit on every route ---------------------------------------------


@pytest.mark.parametrize("path", ROUTES)
def test_too_many_stop_strings_are_400_naming_the_limit(http, path):
    field = stop_field(path)
    stops = [f"stop{i}" for i in range(fields.MAX_STOP_STRINGS + 1)]
    message, param = error(http.post(path, json=body_for(path, **{field: stops})), path)
    assert field in message and f"at most {fields.MAX_STOP_STRINGS} stop strings" in message
    assert param == (None if path == MESSAGES else field)


@pytest.mark.parametrize("path", ROUTES)
def test_a_stop_string_too_long_is_400_naming_the_limit(http, path):
    field = stop_field(path)
    stops = ["x" * (fields.MAX_STOP_STRING_CHARS + 1)]
    message, _ = error(http.post(path, json=body_for(path, **{field: stops})), path)
    assert field in message and f"at most {fields.MAX_STOP_STRING_CHARS} characters" in message


@pytest.mark.parametrize("path", ROUTES)
def test_stops_at_the_limits_are_accepted(http, path):
    stops = [f"never{i}" for i in range(fields.MAX_STOP_STRINGS - 1)] + ["x" * fields.MAX_STOP_STRING_CHARS]
    r = http.post(path, json=body_for(path, **{stop_field(path): stops}))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ROUTES)
def test_stop_token_ids_are_limited(http, path):
    at_limit = list(range(1000, 1000 + fields.MAX_STOP_TOKEN_IDS))
    assert http.post(path, json=body_for(path, stop_token_ids=at_limit)).status_code == 200
    message, _ = error(http.post(path, json=body_for(path, stop_token_ids=[*at_limit, 7])), path)
    assert f"at most {fields.MAX_STOP_TOKEN_IDS} stop token ids" in message


def test_responses_honour_stop(openai_client):
    """vLLM's Responses take stop strings too; they reach the engine, which cuts the text there."""
    kwargs = dict(model=MODEL, input="tell me", max_output_tokens=12, temperature=1.0)
    full = openai_client.responses.create(**kwargs, extra_body={"seed": 7}).output_text
    stop = full[len(full) // 2 :][:3]  # text in the middle of the answer
    cut = openai_client.responses.create(**kwargs, extra_body={"seed": 7, "stop": [stop]})
    assert cut.output_text == full[: full.index(stop)]
    assert cut.usage.output_tokens < 12


# ---- prompts too big for the context are refused before they are encoded ---------------------------------


@pytest.mark.parametrize("path", ROUTES)
def test_a_prompt_that_cannot_fit_is_refused_before_encoding(server, http, path):
    # the main server: a 2048-token context and a 1 MiB body; a DeepSeek token is 128 bytes of text at most
    text = "word " * 120_000  # 600 kB: more than 2048 * 128 bytes
    message, param = error(http.post(path, json=with_prompt(path, text)), path)
    assert "cannot fit in the context of 2048 tokens" in message and "bytes" in message
    assert param == {CHAT: "messages", RESPONSES: "input", COMPLETIONS: "prompt", MESSAGES: None}[path]


def test_a_prompt_near_the_bound_is_still_encoded(http):
    text = "word " * 50_000  # 250 kB: under 2048 * 128 bytes, 50,000 tokens: over the context once encoded
    message, _ = error(http.post(COMPLETIONS, json=with_prompt(COMPLETIONS, text)), COMPLETIONS)
    assert "maximum context length is 2048 tokens" in message


@pytest.fixture(scope="module")
def roomy_server(start_server):
    """The demo model's whole context (8192 tokens: up to 1 MiB of prompt is encoded before it is found too
    long) and an 8 MiB body limit."""
    return start_server("--max-model-len", "8192", "--num-kv-blocks", "64", "--max-request-body-mb", "8")


def big_text(size: int) -> str:
    """About `size` bytes of varied text (~4 bytes a token): encoding a megabyte takes about a second."""
    words = ("alpha", "beta", "gamma", "delta", "épsilon", "中文", "zeta!", "eta,")
    text = " ".join(words[i % len(words)] + str(i % 97) for i in range(size // 6))
    return text.encode()[:size].decode(errors="ignore")


@pytest.mark.parametrize(("path", "size"), [(COMPLETIONS, 1_000_000), (CHAT, 1_000_000), ("/tokenize", 1_000_000)])
def test_health_answers_while_a_big_prompt_is_encoded(roomy_server, path, size):
    """/health keeps answering while a big prompt is encoded: some answer comes in the middle half of the
    big request's time in flight (with encoding on the event loop, none can: the loop is busy)."""
    text = big_text(size)
    body = {"model": MODEL, "prompt": text} if path == "/tokenize" else with_prompt(path, text)
    payload = json.dumps(body, ensure_ascii=False).encode()
    span: dict[str, float] = {}

    def big_request() -> None:
        with httpx.Client(base_url=roomy_server.url, timeout=300) as client:
            span["start"] = time.monotonic()
            r = client.post(path, content=payload, headers={"content-type": "application/json"})
            span["end"] = time.monotonic()
            span["status"], span["text"] = r.status_code, r.text[:300]

    answered: list[float] = []
    thread = threading.Thread(target=big_request)
    thread.start()
    with httpx.Client(base_url=roomy_server.url, timeout=300) as client:
        while thread.is_alive():
            assert client.get("/health").status_code == 200
            answered.append(time.monotonic())
    thread.join()
    if path == "/tokenize":
        assert span["status"] == 200, span
    else:  # encoded, then found longer than the context
        assert span["status"] == 400 and "maximum context length is 8192 tokens" in span["text"], span
    quarter = (span["end"] - span["start"]) / 4
    middle = [t for t in answered if span["start"] + quarter < t < span["end"] - quarter]
    assert middle, f"no /health answer in the middle of the {span['end'] - span['start']:.1f} s big request"


# ---- Responses: what a stateless server cannot do -----------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [("previous_response_id", "resp_123"), ("store", True), ("background", True), ("conversation", "conv_1")],
)
def test_responses_refuse_stored_state(http, field, value):
    message, param = error(http.post(RESPONSES, json=body_for(RESPONSES, **{field: value})), RESPONSES)
    assert param == field and field in message and "stores nothing" in message


def test_responses_accept_what_asks_for_no_state(http, openai_client):
    for extra in ({"store": False}, {"background": False}, {"previous_response_id": None}):
        assert http.post(RESPONSES, json=body_for(RESPONSES, **extra)).status_code == 200, extra
    # the openai client leaves store out unless asked
    assert openai_client.responses.create(model=MODEL, input="hi", max_output_tokens=2).usage.output_tokens <= 2


# ---- tool_choice must fit tools -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "extra", "named"),
    [
        (CHAT, {"tool_choice": "required"}, None),
        (CHAT, {"tool_choice": {"type": "function", "function": {"name": "g"}}}, "g"),
        (CHAT, {"tools": CHAT_TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}}, "g"),
        (RESPONSES, {"tool_choice": "required"}, None),
        (RESPONSES, {"tool_choice": {"type": "function", "name": "g"}}, "g"),
        (RESPONSES, {"tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "g"}}, "g"),
        (MESSAGES, {"tool_choice": {"type": "any"}}, None),
        (MESSAGES, {"tool_choice": {"type": "tool", "name": "g"}}, "g"),
        (MESSAGES, {"tools": MESSAGES_TOOLS, "tool_choice": {"type": "tool", "name": "g"}}, "g"),
    ],
)
def test_tool_choice_must_fit_tools(http, path, extra, named):
    message, param = error(http.post(path, json=body_for(path, **extra)), path)
    assert "tool_choice" in message and param == (None if path == MESSAGES else "tool_choice")
    if named is not None:
        assert repr(named) in message


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        (CHAT, {"tool_choice": "auto"}),
        (CHAT, {"tool_choice": "none"}),
        (CHAT, {"tools": CHAT_TOOLS, "tool_choice": "required"}),
        (CHAT, {"tools": CHAT_TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}}),
        (RESPONSES, {"tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "f"}}),
        (MESSAGES, {"tool_choice": {"type": "auto"}}),
        (MESSAGES, {"tools": MESSAGES_TOOLS, "tool_choice": {"type": "tool", "name": "f"}}),
    ],
)
def test_tool_choice_fitting_tools_is_accepted(http, path, extra):
    r = http.post(path, json=body_for(path, **extra))
    assert r.status_code == 200, r.text


# ---- /v1/messages/count_tokens --------------------------------------------------------------------------------

COUNTED = [
    {"model": MODEL, "messages": [{"role": "user", "content": "how many tokens is this?"}]},
    {
        "model": MODEL,
        "system": "You are terse.",
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
        ],
        "tools": MESSAGES_TOOLS,
        "tool_choice": {"type": "auto"},
    },
    {
        "model": MODEL,
        "messages": [{"role": "user", "content": "think first"}],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    },
]


def prompt_tokens_of_messages(http, body: dict) -> int:
    """The prompt tokens /v1/messages counts for `body` (cache reads included)."""
    r = http.post(MESSAGES, json={**body, "max_tokens": 1})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    cached = (usage.get("cache_read_input_tokens") or 0) + (usage.get("cache_creation_input_tokens") or 0)
    return usage["input_tokens"] + cached


@pytest.fixture(scope="module")
def local_state(recipe):
    """A ServerState as `deepinfer serve` builds it, without an engine (count_tokens does not run one)."""
    from deepinfer_core.engine.tokenizer import Tokenizer, demo_tokenizer_dir
    from deepinfer_core.serve.metrics import ServerMetrics
    from deepinfer_core.serve.state import ServerState

    recipe_tokenizer, encoding, options = recipe
    return ServerState(
        engine=None,
        served_model_name=MODEL,
        tokenizer=Tokenizer.from_dir(demo_tokenizer_dir()),
        recipe_tokenizer=recipe_tokenizer,
        encoding=encoding,
        options=options,
        max_model_len=2048,
        eos_token_ids=frozenset(),
        metrics=ServerMetrics(),
    )


@pytest.mark.parametrize("body", COUNTED)
def test_count_tokens_counts_what_messages_feeds_the_model(http, local_state, body):
    from deepinfer_core.serve.tokenize import run_count_tokens

    kind, payload = asyncio.run(run_count_tokens(local_state, body))
    assert kind == "json" and json.loads(payload) == {"input_tokens": prompt_tokens_of_messages(http, body)}


def test_count_tokens_refuses_what_messages_refuses(local_state):
    from deepinfer_core.serve.errors import ApiError
    from deepinfer_core.serve.tokenize import run_count_tokens

    for body, status in (
        ({**COUNTED[0], "model": "other"}, 404),
        ({**COUNTED[0], "tool_choice": {"type": "any"}}, 400),
        ({"model": MODEL, "messages": 5}, 400),
    ):
        with pytest.raises(ApiError) as err:
            asyncio.run(run_count_tokens(local_state, body))
        assert err.value.status == status


@pytest.mark.parametrize("body", COUNTED)
def test_count_tokens_route(http, body):
    """The route (wired in app.py) answers as Anthropic's, with the count /v1/messages uses."""
    r = http.post(MESSAGES + "/count_tokens", json=body)
    assert r.status_code == 200, r.text
    assert r.json() == {"input_tokens": prompt_tokens_of_messages(http, body)}
