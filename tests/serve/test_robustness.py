"""What one client does must not hurt the others: leaving before admission, out-of-range numbers."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

MODEL = "deepinfer-demo-deepseek-v4-random"

LONG_PROMPT = list(range(1000, 2900))  # 1,900 token ids: one prefill step of ~2 s on one CPU thread


@pytest.fixture(scope="module")
def lone_server(start_server):
    """A server of its own: if a test here broke its engine loop, no other test would be hit."""
    return start_server("--num-kv-blocks", "32", "--max-num-batched-tokens", "2048")


def test_a_client_that_leaves_before_admission_leaves_the_server_serving(lone_server):
    url = lone_server.url
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 1}
    long_request = threading.Thread(target=lambda: httpx.post(url + "/v1/completions", json=body, timeout=120))
    long_request.start()
    time.sleep(0.3)  # its step has begun
    for _ in range(3):  # each: queued behind the long prefill, then gone before the engine takes it
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=0.3)
    long_request.join()
    answer = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    lone_server.assert_no_tracebacks()


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(("field", "value"), [("top_k", 10**19), ("top_k", 2**31), ("min_tokens", 10**19)])
def test_out_of_range_integers_are_400_naming_the_field(http, server, route, field, value):
    body = {"model": MODEL, "max_tokens": 2, field: value}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in route else {"prompt": "hi"}
    answer = http.post(route, json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == field
    assert not server.server_errors()


def test_tokenize_says_invalid_request_body_once(http):
    answer = http.post("/tokenize", json={"model": MODEL, "messages": "not a list"})
    assert answer.status_code == 400
    message = answer.json()["error"]["message"]
    assert message.count("invalid request body") <= 1, message


@pytest.mark.parametrize("field", ["add_special_tokens", "continue_final_message"])
def test_tokenize_refuses_what_it_cannot_do_with_messages(http, field):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], field: True}
    answer = http.post("/tokenize", json=body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == field
