"""Access control of a server started with `--api-key secret`: every /v1 route refuses a missing or wrong key
with a 401 in its protocol's format (before reading the body); the right key works (Bearer on the OpenAI
routes, x-api-key on /v1/messages); /health and /metrics stay open."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

MODEL = "deepinfer-demo-deepseek-v4-random"
KEY = "secret"
BODIES = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 1},
    "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 1},
    "/v1/messages": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
}
ROUTES = [("GET", "/v1/models")] + [("POST", path) for path in BODIES]
WRONG_HEADERS = [
    {},
    {"authorization": "Bearer wrong"},
    {"authorization": f"Bearer {KEY}x"},
    {"authorization": "Bearer"},
    {"x-api-key": "wrong"},
    {"authorization": f"Basic {KEY}"},
]


def assert_401(r: httpx.Response, path: str) -> None:
    assert r.status_code == 401, (r.status_code, r.text)
    body = r.json()
    if path == "/v1/messages":
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error", body
    else:
        assert body["error"]["type"] == "authentication_error" and body["error"]["code"] == "invalid_api_key", body


@pytest.fixture(scope="module")
def raw(auth_server):
    with httpx.Client(base_url=auth_server.url, timeout=60) as client:
        yield client


@pytest.mark.parametrize(("method", "path"), ROUTES)
@pytest.mark.parametrize("headers", WRONG_HEADERS, ids=lambda h: ",".join(f"{k}={v}" for k, v in h.items()) or "none")
def test_missing_or_wrong_key_is_401(raw, method, path, headers):
    r = raw.request(method, path, json=BODIES.get(path), headers=headers)
    assert_401(r, path)


@pytest.mark.parametrize("path", BODIES)
def test_refused_before_the_body_is_read(raw, path):
    r = raw.post(path, content=b"{not json", headers={"authorization": "Bearer wrong", "x-api-key": "wrong"})
    assert_401(r, path)


def test_openai_routes_take_bearer_only(raw):
    for path, body in BODIES.items():
        if path != "/v1/messages":
            assert_401(raw.post(path, json=body, headers={"x-api-key": KEY}), path)


def test_right_key_works_with_the_openai_client(auth_server):
    client = openai.OpenAI(
        base_url=auth_server.url + "/v1",
        api_key=KEY,
        max_retries=0,
        default_headers={"Connection": "close"},
        timeout=60,
    )
    assert [m.id for m in client.models.list().data] == [MODEL]
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 1
    completion = client.completions.create(model=MODEL, prompt="hi", max_tokens=1, temperature=0)
    assert completion.choices[0].finish_reason == "length"
    response = client.responses.create(model=MODEL, input="hi", max_output_tokens=1, temperature=0)
    assert response.status == "incomplete" and response.usage.output_tokens == 1
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0, stream=True)
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "length"


def test_wrong_key_with_the_openai_client(auth_server):
    client = openai.OpenAI(
        base_url=auth_server.url + "/v1",
        api_key="wrong",
        max_retries=0,
        default_headers={"Connection": "close"},
        timeout=60,
    )
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        client.responses.create(model=MODEL, input="hi", max_output_tokens=1)


def test_right_key_works_with_the_anthropic_client(auth_server):
    client = anthropic.Anthropic(
        base_url=auth_server.url, api_key=KEY, max_retries=0, default_headers={"Connection": "close"}, timeout=60
    )
    greedy = {"temperature": 0}
    m = client.messages.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1, extra_body=greedy
    )
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 1
    with client.messages.stream(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2) as s:
        assert s.get_final_message().stop_reason == "max_tokens"
    # a Bearer token (Anthropic's auth_token) is accepted on /v1/messages as well
    bearer = anthropic.Anthropic(
        base_url=auth_server.url, auth_token=KEY, max_retries=0, default_headers={"Connection": "close"}, timeout=60
    )
    assert bearer.messages.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1).id


def test_wrong_key_with_the_anthropic_client(auth_server):
    client = anthropic.Anthropic(
        base_url=auth_server.url, api_key="wrong", max_retries=0, default_headers={"Connection": "close"}, timeout=60
    )
    with pytest.raises(anthropic.AuthenticationError) as err:
        client.messages.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "authentication_error"


def test_health_and_metrics_stay_open(raw):
    assert raw.get("/health").json() == {"status": "ok"}
    r = raw.get("/metrics")
    assert r.status_code == 200 and "deepinfer_kv_blocks_used" in r.text


def test_refusals_are_counted_and_nothing_crashed(auth_server):
    counted = auth_server.metrics()
    assert counted['deepinfer_requests_total{endpoint="chat_completions",status="401"}'] > 0
    assert auth_server.server_errors() == {}
    auth_server.assert_no_tracebacks()


def test_the_key_without_the_bearer_scheme_is_refused(raw):
    for path, body in BODIES.items():
        if path != "/v1/messages":
            assert_401(raw.post(path, json=body, headers={"authorization": KEY}), path)


def test_unknown_routes_answer_in_the_protocols_format(raw):
    openai_style = raw.get("/v1/nope").json()
    assert openai_style["error"]["type"] == "not_found_error" and "/v1/nope" in openai_style["error"]["message"]
    anthropic_style = raw.get("/v1/messages").json()  # wrong method
    assert anthropic_style["type"] == "error" and "Method Not Allowed" in anthropic_style["error"]["message"]
