"""Routes, valid bodies and request/answer helpers shared by the fuzzing of a live server (test_fuzz.py,
test_fuzz_http.py).

Errors are in the route's protocol format: OpenAI's {"error": {"message", "type", ...}}, Anthropic's
{"type": "error", "error": {"type", "message"}} on /v1/messages*. The server's OpenAPI schema declares no
request bodies (every route reads the raw body itself), so a schema-driven fuzzer such as schemathesis would
have nothing to generate from; the requests are raw HTTP (httpx, or a socket where the framing itself is
wrong), each with a client timeout.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serve.conftest import MODEL, Server

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
COMPLETIONS = "/v1/completions"
MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"
BODY_ROUTES = [CHAT, RESPONSES, MESSAGES, COUNT_TOKENS, COMPLETIONS, TOKENIZE, DETOKENIZE]
TIMEOUT = 30  # seconds a client waits for an answer: longer is a hang
HI = [{"role": "user", "content": "hi"}]
VALID = {  # the smallest valid body of each route (one output token where there is generation)
    CHAT: {"model": MODEL, "messages": HI, "max_tokens": 1, "temperature": 0},
    RESPONSES: {"model": MODEL, "input": "hi", "max_output_tokens": 1, "temperature": 0},
    MESSAGES: {"model": MODEL, "messages": HI, "max_tokens": 1, "temperature": 0},
    COUNT_TOKENS: {"model": MODEL, "messages": HI},
    COMPLETIONS: {"model": MODEL, "prompt": "hi", "max_tokens": 1, "temperature": 0},
    TOKENIZE: {"model": MODEL, "prompt": "hi"},
    DETOKENIZE: {"model": MODEL, "tokens": [1, 2]},
}


def dumps(body) -> bytes:
    """JSON as a client would send it: NaN and Infinity as Python writes them, lone surrogates escaped."""
    try:
        return json.dumps(body).encode()
    except (ValueError, UnicodeEncodeError):
        return json.dumps(body, ensure_ascii=True).encode()


# ---- answers ------------------------------------------------------------------------------------------------


def assert_error_format(path: str, payload: bytes) -> dict:
    """-> the error object of an error answer in the route's protocol format (Anthropic's on /v1/messages*)."""
    try:
        body = json.loads(payload)
    except ValueError:
        raise AssertionError(f"{path}: the error answer is not JSON: {payload[:300]!r}") from None
    if path.startswith(MESSAGES):
        assert body.get("type") == "error" and isinstance(body.get("error"), dict), body
    else:
        assert isinstance(body, dict) and isinstance(body.get("error"), dict), body
    error = body["error"]
    assert isinstance(error.get("message"), str) and error["message"] and isinstance(error.get("type"), str), body
    return error


def send(http: httpx.Client, method: str, path: str, raw: bytes = b"", **headers: str) -> tuple[httpx.Response, bytes]:
    """One request, the whole answer read (streams included) within TIMEOUT; headers with "-" spelled "_"."""
    headers = {name.replace("_", "-"): value for name, value in headers.items()}
    with http.stream(method, path, content=raw, headers=headers, timeout=TIMEOUT) as r:
        return r, r.read()


def assert_answered(path: str, r: httpx.Response, payload: bytes, sent=None) -> None:
    """Never a 5xx; an error in the route's format; anything else a 200."""
    assert r.status_code < 500, (r.request.method, path, r.status_code, sent, payload[:500])
    if r.status_code >= 400:
        if r.request.method != "HEAD":
            assert_error_format(path, payload)
    else:
        assert r.status_code == 200, (r.request.method, path, r.status_code, sent, payload[:500])


def served_paths(http: httpx.Client) -> set[str]:
    """The paths the server has (its OpenAPI schema)."""
    return set(http.get("/openapi.json").json()["paths"])


def require(path: str, served: set[str]) -> None:
    # /v1/messages/count_tokens is being added (issue #14): until the server has it, its cases are skipped
    if path == COUNT_TOKENS and path not in served:
        pytest.skip(f"the server has no {COUNT_TOKENS} yet")


def assert_healthy_after_fuzzing(server: Server, http: httpx.Client) -> None:
    """The main server, once fuzzed: healthy, no 5xx counted, nothing running or holding KV blocks, no traceback."""
    assert http.get("/health").json() == {"status": "ok"}
    assert server.server_errors() == {}
    assert server.wait_idle() == (0, 0, 0)
    server.assert_no_tracebacks()
