"""Bad requests are answered in the caller's protocol with a 4xx, never a 500, and the server keeps serving.

OpenAI routes answer {"error": {"message", "type", "param", "code"}}; /v1/messages answers Anthropic's
{"type": "error", "error": {"type", "message"}}.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

MODEL = "deepinfer-demo-deepseek-v4-random"
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
COMPLETIONS = "/v1/completions"
MESSAGES = "/v1/messages"
ROUTES = [CHAT, RESPONSES, COMPLETIONS, MESSAGES]
LONG_TEXT = "hello " * 3000  # ~3000 tokens: more than the 2048-token context


def valid_body(path: str, **overrides) -> dict:
    body = {
        CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        RESPONSES: {"model": MODEL, "input": "hi", "max_output_tokens": 2},
        COMPLETIONS: {"model": MODEL, "prompt": "hi", "max_tokens": 2},
        MESSAGES: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    }[path]
    return {**body, "temperature": 0, **overrides}


def max_tokens_key(path: str) -> str:
    return "max_output_tokens" if path == RESPONSES else "max_tokens"


def assert_error(response: httpx.Response, path: str, status: int, error_type: str | None = None) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    if path == MESSAGES:
        assert body["type"] == "error" and set(body["error"]) >= {"type", "message"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
        kind = body["error"]["type"]
    else:
        assert set(body) == {"error"} and set(body["error"]) >= {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
        kind = body["error"]["type"]
    if error_type is not None:
        assert kind == error_type, body
    return body


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("raw", [b"{bad json", b"", b"\xff\xfe\x00", b"[1, 2]", b"null", b'"text"'])
def test_malformed_or_non_object_json_is_400(http, path, raw):
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert_error(r, path, 400, "invalid_request_error")


@pytest.mark.parametrize("path", ROUTES)
def test_unknown_model_is_404(http, path):
    r = http.post(path, json=valid_body(path, model="no-such-model"))
    body = assert_error(r, path, 404, "not_found_error")
    if path != MESSAGES:
        assert body["error"]["param"] == "model" and body["error"]["code"] == "model_not_found"


def test_unknown_model_through_the_clients(openai_client, anthropic_client):
    with pytest.raises(openai.NotFoundError) as err:
        openai_client.chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 404 and err.value.body["code"] == "model_not_found"
    with pytest.raises(anthropic.NotFoundError) as err:
        anthropic_client.messages.create(model="claude-nope", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert err.value.status_code == 404
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("max_tokens", [100_000, 2048, 10**9])
def test_max_tokens_beyond_the_context_is_400(http, path, max_tokens):
    r = http.post(path, json=valid_body(path, **{max_tokens_key(path): max_tokens}))
    assert_error(r, path, 400, "invalid_request_error")


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("max_tokens", [0, -1, "many", 2.5])
def test_invalid_max_tokens_is_400(http, path, max_tokens):
    r = http.post(path, json=valid_body(path, **{max_tokens_key(path): max_tokens}))
    assert_error(r, path, 400)


@pytest.mark.parametrize("path", ROUTES)
def test_prompt_longer_than_the_context_is_400(http, path):
    if path == COMPLETIONS:
        body = valid_body(path, prompt=LONG_TEXT)
    elif path == RESPONSES:
        body = valid_body(path, input=LONG_TEXT)
    else:
        body = valid_body(path, messages=[{"role": "user", "content": LONG_TEXT}])
    assert_error(http.post(path, json=body), path, 400, "invalid_request_error")


def test_token_id_prompt_filling_the_context_is_400(http):
    assert_error(
        http.post(COMPLETIONS, json=valid_body(COMPLETIONS, prompt=[100] * 2048, max_tokens=1)), COMPLETIONS, 400
    )
    # the engine refuses it too (no room for one generated token), with its own message, still a 400
    assert_error(http.post(COMPLETIONS, json=valid_body(COMPLETIONS, prompt=[100] * 4000)), COMPLETIONS, 400)


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize(
    "params",
    [
        {"temperature": -1},
        {"temperature": 2.5},
        {"temperature": "hot"},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_p": -0.1},
    ],
)
def test_invalid_sampling_parameters_are_400(http, path, params):
    r = http.post(path, json=valid_body(path, **params))
    assert_error(r, path, 400, "invalid_request_error")


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(
    "params",
    [
        {"seed": -1},
        {"seed": 2**64},
        {"seed": 10**30},  # beyond any integer type: must not crash the JSON reader
        {"stop": [""]},
        {"logprobs": 50},
        {"n": 0},
    ],
)
def test_invalid_openai_parameters_are_400(http, path, params):
    if path == CHAT and "logprobs" in params:
        params = {"logprobs": True, "top_logprobs": 50}
    r = http.post(path, json=valid_body(path, **params))
    assert_error(r, path, 400, "invalid_request_error")


def test_invalid_parameters_through_the_clients(openai_client, anthropic_client):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError):
        openai_client.chat.completions.create(model=MODEL, messages=messages, temperature=-1, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        openai_client.completions.create(model=MODEL, prompt="hi", top_p=0, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        openai_client.responses.create(model=MODEL, input="hi", top_p=0, max_output_tokens=2)
    with pytest.raises(anthropic.BadRequestError) as err:
        anthropic_client.messages.create(model=MODEL, messages=messages, max_tokens=2, extra_body={"top_p": 0})
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("path", "content"),
    [
        (CHAT, [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]),
        (CHAT, [{"type": "no_such_part", "text": "hi"}]),
        (CHAT, 12),
        (CHAT, {"text": "hi"}),
        (MESSAGES, [{"type": "no_such_block", "text": "hi"}]),
        (MESSAGES, 12),
    ],
)
def test_unsupported_content_is_400(http, path, content):
    body = valid_body(path, messages=[{"role": "user", "content": content}])
    assert_error(http.post(path, json=body), path, 400, "invalid_request_error")


@pytest.mark.parametrize(
    ("path", "content"),
    [
        (CHAT, [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]),
        (CHAT, [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}]),
        (
            MESSAGES,
            [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}],
        ),
    ],
)
def test_image_parts_are_never_a_server_error(http, path, content):
    """The demo model is text-only: an image part is accepted or refused, but never crashes the server."""
    body = valid_body(path, messages=[{"role": "user", "content": [{"type": "text", "text": "what?"}, *content]}])
    r = http.post(path, json=body)
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        assert_error(r, path, r.status_code)


@pytest.mark.parametrize("path", ROUTES)
def test_body_over_the_limit_is_413(http, path):
    """The main server takes at most 1 MiB (--max-request-body-mb 1)."""
    # (just over the limit: the server answers without reading it all, and what the client is still
    # sending must fit in the socket buffers for it to read the answer)
    big = valid_body(path, padding="x" * ((1 << 20) + (64 << 10)))
    r = http.post(path, json=big)  # a declared Content-Length over the limit
    assert_error(r, path, 413, "request_too_large" if path == MESSAGES else "invalid_request_error")

    def chunks():  # no Content-Length: the limit holds while reading
        for _ in range(5):
            yield b" " * (256 << 10)
        yield b"{}"

    r = http.post(path, content=chunks(), headers={"content-type": "application/json"})
    assert_error(r, path, 413)


def test_body_just_under_the_limit_is_read(http):
    body = httpx.Request("POST", "/", json=valid_body(CHAT)).content
    padded = body[:-1] + b" " * ((1 << 20) - len(body) - 16) + b"}"
    assert len(padded) < 1 << 20
    r = http.post(CHAT, content=padded, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("field", ["model", "text"])
def test_lone_surrogates_are_400(http, path, field):
    """JSON lets "\\ud800" through the parser, but it is no text: refused up front, in the protocol's format."""
    body = valid_body(path)
    if field == "model":
        body["model"] = "\ud800"
    elif path == COMPLETIONS:
        body["prompt"] = "a \udfff b"
    elif path == RESPONSES:
        body["input"] = "a \udfff b"
    else:
        body["messages"] = [{"role": "user", "content": "a \udfff b"}]
    r = http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert_error(r, path, 400, "invalid_request_error")
    # a proper surrogate pair is one character, and fine
    body = json.loads(json.dumps(valid_body(path)).replace('"hi"', '"\\ud83d\\ude00"'))
    assert http.post(path, json=body).status_code == 200


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("depth", [200, 100_000])
def test_deeply_nested_bodies_are_400(http, path, depth):
    nested = b"[" * depth + b"1" + b"]" * depth
    raw = json.dumps(valid_body(path, metadata="NESTED")).encode().replace(b'"NESTED"', nested)
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    if path == COMPLETIONS and depth == 200:  # an unknown field it ignores
        assert r.status_code == 200, r.text
    else:
        assert_error(r, path, 400, "invalid_request_error")


def test_completions_refuses_what_it_does_not_support(http):
    for params in ({"suffix": "x"}, {"prompt": ["a", [1]]}, {"prompt": []}, {"prompt": [-1]}, {"prompt": [10**9]}):
        assert_error(http.post(COMPLETIONS, json=valid_body(COMPLETIONS, **params)), COMPLETIONS, 400)


def test_wrong_methods_and_paths_are_4xx(http):
    assert http.get(CHAT).status_code == 405
    assert http.post("/v1/nope", json={}).status_code == 404
    assert http.delete("/v1/models").status_code == 405


def test_server_still_serves_after_the_errors(server, http, openai_client):
    """Runs after the error tests of this module: the server answers normally and logged no crash."""
    r = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
    )
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens <= 2
    assert http.get("/health").json() == {"status": "ok"}
    assert server.server_errors() == {}
    server.assert_no_tracebacks()
