"""The HTTP layer under hostile or careless clients: methods and content types, auth header spelling,
request ids, CORS, read deadlines, the connection cap, clients that leave mid-upload, and a shutdown
whose grace period runs out under streams."""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.serve.conftest import API_KEY, MODEL, Server

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_wrong_method_is_405_with_allow(http):
    r = http.get(CHAT)
    assert r.status_code == 405
    assert r.headers["allow"] == "POST"
    assert "takes POST" in r.json()["error"]["message"]
    r = http.delete("/health")
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "HEAD"}


@pytest.mark.parametrize("path", ["/health", "/ping", "/version", "/v1/models", "/metrics"])
def test_head_works_where_get_does(http, path):
    r = http.head(path)
    assert r.status_code == 200, r.text
    assert r.content == b""


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer", "bEaReR"])
def test_bearer_scheme_is_case_insensitive(start_server, auth_server, scheme):
    headers = {"authorization": f"{scheme} {API_KEY}", "connection": "close"}
    r = httpx.post(auth_server.url + CHAT, json=CHAT_BODY, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(auth_server.url + CHAT, json=CHAT_BODY, headers={**headers, "authorization": f"{scheme} no"})
    assert r.status_code == 401


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "garbage"],
)
@pytest.mark.parametrize("path", [CHAT, "/v1/completions", MESSAGES, RESPONSES, "/tokenize"])
def test_non_json_bodies_are_415(http, path, content_type):
    headers = {} if content_type is None else {"content-type": content_type}
    r = http.post(path, content=json.dumps(CHAT_BODY).encode(), headers=headers)
    assert r.status_code == 415, r.text
    body = r.json()
    message = body["error"]["message"]
    assert "application/json" in message
    if path == MESSAGES:
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    else:
        assert body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "content_type", ["application/json; charset=utf-8", "Application/JSON", "application/vnd.x+json"]
)
def test_json_content_types_are_accepted(http, content_type):
    r = http.post(CHAT, content=json.dumps(CHAT_BODY).encode(), headers={"content-type": content_type})
    assert r.status_code == 200, r.text


def test_request_id_is_echoed_or_generated(server, http):
    r = http.get("/health", headers={"x-request-id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    r = http.post(CHAT, json=CHAT_BODY, headers={"x-request-id": "trace-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    assert re.search(r"Finished request \S+: route=chat_completions x_request_id=trace-42 status=200", server.log())
    generated = http.get("/health").headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", generated)
    assert http.get("/health").headers["x-request-id"] != generated
    r = http.post(CHAT, json=CHAT_BODY, headers={"x-request-id": "x" * 300})
    assert r.status_code == 400 and "x-request-id" in r.json()["error"]["message"]


def test_no_cors_headers_by_default(http):
    r = http.options(CHAT, headers={"origin": "https://evil.example", "access-control-request-method": "POST"})
    assert "access-control-allow-origin" not in r.headers
    assert r.status_code == 405


def test_cors_with_allowed_origins(strict_server):
    server = strict_server  # allows one origin (a server started for CORS alone cost ~5 s)
    preflight = {"origin": "https://app.example", "access-control-request-method": "POST"}
    r = httpx.options(server.url + CHAT, headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    r = httpx.options(server.url + CHAT, headers={**preflight, "origin": "https://evil.example"})
    assert r.headers.get("access-control-allow-origin") != "https://evil.example"
    r = httpx.post(server.url + CHAT, json=CHAT_BODY, headers={"origin": "https://app.example"}, timeout=60)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"


# --- read deadlines and the connection cap ------------------------------------------------------------


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


@pytest.fixture(scope="module")
def strict_server(start_server):
    return start_server(
        "--num-kv-blocks", "16", "--timeout-request-header", "1", "--timeout-request-body", "1",
        "--limit-concurrency", "6", "--allowed-origins", '["https://app.example"]',
    )  # fmt: skip


def test_idle_connection_is_closed(strict_server):
    with _connect(strict_server.port) as sock:
        started = time.monotonic()
        assert _read_all(sock) == b""  # closed without a word: it never asked anything
        assert time.monotonic() - started < 20


def test_slow_head_gets_408(strict_server):
    with _connect(strict_server.port) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")  # ... and never the rest
        reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert b"--timeout-request-header" in reply
    assert httpx.get(strict_server.url + "/health").status_code == 200


def test_stalled_body_gets_408_and_one_log_line(strict_server):
    before = strict_server.log().count("status=408")
    with _connect(strict_server.port) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b'content-length: 1000\r\n\r\n{"model":'
        )
        reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert b"--timeout-request-body" in reply
    deadline = time.monotonic() + 10
    while strict_server.log().count("status=408") == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert strict_server.log().count("status=408") == before + 1
    strict_server.assert_no_tracebacks()
    assert not strict_server.server_errors()


def test_keep_alive_connection_stays_usable_for_the_next_request(strict_server):
    with httpx.Client(base_url=strict_server.url) as client:  # keep-alive: one connection, two requests
        assert client.get("/health").status_code == 200
        time.sleep(0.5)  # under --timeout-keep-alive (5 s): the idle gap is not a slow head
        assert client.get("/health").status_code == 200


def test_connections_beyond_the_limit_get_503(strict_server):
    idle = [_connect(strict_server.port) for _ in range(6)]
    try:
        with _connect(strict_server.port) as extra:
            reply = _read_all(extra)
        assert reply.startswith(b"HTTP/1.1 503"), reply
        assert b"--limit-concurrency" in reply and b"retry-after: 1" in reply.lower()
    finally:
        for sock in idle:
            sock.close()
    strict_server.wait_ready(10)  # the closed ones free their places


def test_running_out_of_file_descriptors_logs_one_line_and_recovers(tmp_path):
    # a connection limit above what the process may open: accept() itself fails (EMFILE), again and again
    args = ["--num-kv-blocks", "16", "--limit-concurrency", "100000"]
    server = Server(args, tmp_path / "server.log", max_open_files=256)
    server.start().wait_ready()
    try:
        held = []
        for _ in range(server.max_open_files + 50):
            try:
                held.append(_connect(server.port))
            except OSError:
                break
        time.sleep(3)  # asyncio retries the accept every second meanwhile
        for sock in held:
            sock.close()
        server.wait_ready(10)  # it recovers once the connections are gone
        log = server.log()
        assert "Traceback" not in log, log[-3000:]
        assert log.count("Too many open files") == 1, log[-3000:]
        assert "--limit-concurrency" in log
    finally:
        server.stop()


def test_client_leaving_mid_upload_is_499_not_500(server):
    before = server.log().count("status=499")
    with _connect(server.port) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 100000\r\n\r\n" + b'{"model": ' + b" " * 5000
        )
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    while server.log().count("status=499") == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.log().count("status=499") == before + 1, server.log()[-3000:]
    assert not server.server_errors()
    server.assert_no_tracebacks()
    assert 'status="499"' in "\n".join(n for n in server.metrics() if n.startswith("deepinfer_requests_total"))


# --- shutdown grace running out under streams ---------------------------------------------------------


def _stream_events(url: str, path: str, body: dict, into: list, started: threading.Event) -> None:
    try:
        with httpx.stream("POST", url + path, json=body, timeout=60) as r:
            into.append(("status", r.status_code))
            for line in r.iter_lines():
                into.append(("line", line))
                started.set()
    except httpx.HTTPError as err:
        into.append(("error", repr(err)))
    finally:
        started.set()


def test_grace_expiry_ends_streams_with_the_protocols_error_event(start_server):
    server = start_server("--num-kv-blocks", "64", "--shutdown-grace-period", "1")
    long = {"max_tokens": 1500, "stream": True, "temperature": 0, "ignore_eos": True}
    bodies = {
        CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **long},
        MESSAGES: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **long},
        RESPONSES: {
            "model": MODEL,
            "input": "hi",
            "max_output_tokens": 1500,
            "stream": True,
            "temperature": 0,
            "ignore_eos": True,
        },
        "/v1/completions": {"model": MODEL, "prompt": "hi", **long},
    }
    results = {path: [] for path in bodies}
    threads = []
    for path, body in bodies.items():
        started = threading.Event()
        thread = threading.Thread(target=_stream_events, args=(server.url, path, body, results[path], started))
        thread.start()
        assert started.wait(60)
        threads.append(thread)
    server.process.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive()
    assert server.process.wait(30) == 0, server.log()[-3000:]

    def lines(path: str) -> list[str]:
        assert ("status", 200) in results[path], results[path]
        assert not [r for r in results[path] if r[0] == "error"], results[path]
        return [text for kind, text in results[path] if kind == "line" and text]

    for path in (CHAT, "/v1/completions"):
        got = lines(path)
        assert got[-1] == "data: [DONE]", got[-3:]
        error = json.loads(got[-2].removeprefix("data: "))["error"]
        assert error["code"] == "server_shutting_down" and "--shutdown-grace-period" in error["message"]
    got = lines(MESSAGES)
    assert got[-2] == "event: error", got[-3:]
    assert json.loads(got[-1].removeprefix("data: "))["error"]["type"] == "overloaded_error"
    got = lines(RESPONSES)
    assert got[-2] == "event: error", got[-3:]
    event = json.loads(got[-1].removeprefix("data: "))
    sequence = [json.loads(t.removeprefix("data: "))["sequence_number"] for t in got if t.startswith("data: ")]
    assert event["type"] == "error" and event["code"] == "server_shutting_down"
    assert sequence == list(range(len(sequence)))  # the error event continues the numbering

    log = server.log()
    assert "Traceback" not in log and "Cancel" not in log, log[-4000:]
    for route in ("chat_completions", "messages", "responses", "completions"):
        assert len(re.findall(rf"route={route} \S+ status=503", log)) == 1, log[-4000:]
