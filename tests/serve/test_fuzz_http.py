"""Fuzzing the HTTP layer of every route of a live server (issue #14): no method, path, content type or
framing, however wrong, gets a 5xx or a hang.

Route by route (every route of app.py; /v1/messages/count_tokens once the server has it):
- methods: GET, POST, PUT, DELETE, PATCH, HEAD, OPTIONS. A method a route does not take is a 405 in the
  route's error format whose `Allow` says what it takes; HEAD answers as GET does, without the body.
- paths: an unknown path is a 404 in the error format; an odd one (trailing slash, %00, dot segments, very
  long) is no 5xx.
- content types: a body route takes JSON, that is application/json (parameters allowed) or
  application/*+json; any other (text/plain, a form, multipart, garbage), or no Content-Type at all, is a 415
  in the route's error format. `curl -d` without `-H 'Content-Type: application/json'` sends a form: a 415
  that says so.
- framing: a Content-Length that lies (shorter or longer than the body, malformed, huge) is a 4xx or a
  closed connection, never a 5xx, and a stalled body holds up no one else. These requests go over raw
  sockets to a server of their own.
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests.serve.conftest import MODEL
from tests.serve.fuzz_support import (
    BODY_ROUTES,
    CHAT,
    COMPLETIONS,
    MESSAGES,
    TIMEOUT,
    VALID,
    assert_answered,
    assert_error_format,
    assert_healthy_after_fuzzing,
    dumps,
    require,
    send,
    served_paths,
)

METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS")
ROUTE_METHODS = {  # every route of app.py, and the methods it takes
    **{path: {"POST"} for path in BODY_ROUTES},
    "/v1/models": {"GET"},
    f"/v1/models/{MODEL}": {"GET"},
    "/version": {"GET"},
    "/health": {"GET"},
    "/ping": {"GET", "POST"},
    "/metrics": {"GET"},
}


@pytest.fixture(scope="module")
def served(http) -> set[str]:
    return served_paths(http)


# ---- methods and paths --------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", list(ROUTE_METHODS))
def test_every_method_is_answered_and_a_wrong_one_is_405(http, served, path):
    require(path, served)
    for method in METHODS:
        r, payload = send(http, method, path)
        assert r.status_code < 500 and r.status_code != 404, (method, path, r.status_code, payload[:300])
        if method in ROUTE_METHODS[path]:
            assert_answered(path, r, payload)
            assert r.status_code != 405, (method, path, payload[:300])
        elif method == "HEAD" and "GET" in ROUTE_METHODS[path]:
            continue  # answered as GET is: test_head_answers_as_get_does
        elif method == "OPTIONS":  # a 405 like any other method, or an answer saying what the route takes
            assert r.status_code in (200, 204, 405), (method, path, r.status_code, payload[:300])
        else:
            assert r.status_code == 405, (method, path, r.status_code, payload[:300])
            if method != "HEAD":
                assert_error_format(path, payload)


@pytest.mark.parametrize("path", list(ROUTE_METHODS))
def test_a_405_says_which_methods_the_route_takes(http, served, path):
    """RFC 9110: a 405 carries `Allow`; so does an answer to OPTIONS."""
    require(path, served)
    takes = ROUTE_METHODS[path]
    for method in METHODS:
        if method in takes or (method == "HEAD" and "GET" in takes):
            continue
        r, _ = send(http, method, path)
        allow = {m.strip().upper() for m in r.headers.get("allow", "").split(",") if m.strip()}
        said = f"{method} {path} -> {r.status_code} with Allow: {r.headers.get('allow')!r}"
        assert allow >= takes, f"{said}; the route takes {sorted(takes)}"
        if r.status_code == 405:
            assert method not in allow, said


@pytest.mark.parametrize("path", [path for path, takes in ROUTE_METHODS.items() if "GET" in takes])
def test_head_answers_as_get_does(http, path):
    """RFC 9110: every server supports HEAD where it supports GET (load balancers probe /health with it)."""
    get, _ = send(http, "GET", path)
    head, payload = send(http, "HEAD", path)
    assert head.status_code == get.status_code == 200, f"GET {path} -> {get.status_code}, HEAD -> {head.status_code}"
    assert payload == b""


UNKNOWN_PATHS = ["/", "/v1", "/v1/nope", "/nope", "/V1/CHAT/COMPLETIONS", "/v1/chat", "/v1/messages/nope", "/v2/models"]
ODD_PATHS = [
    "/v1/chat/completions/", "/v1/models/", "/v1/models/nope", "/v1/models/a/b/c", "/v1/models/%00", "/v1/models/%ff",
    "//v1/chat/completions", "/v1/chat/completions?x=%00&y", "/v1/./chat/../chat/completions", "/" + "a" * 6000,
    "/..%2f..%2fetc%2fpasswd", "/health/", "/metrics?name[]=1",
]  # fmt: skip


def test_unknown_paths_are_404_and_odd_ones_no_server_error(http):
    for path in UNKNOWN_PATHS:
        for method in ("GET", "POST", "DELETE"):
            r, payload = send(http, method, path)
            assert r.status_code == 404, (method, path, r.status_code, payload[:300])
            assert_error_format(path, payload)
    for path in ODD_PATHS:
        for method in ("GET", "POST", "HEAD"):
            r, payload = send(http, method, path, b"{}", content_type="application/json")
            assert r.status_code < 500, (method, path, r.status_code, payload[:300])
            if r.status_code >= 400 and method != "HEAD":
                assert_error_format(path, payload)


# ---- content types ------------------------------------------------------------------------------------------

JSON_TYPES = [
    "application/json",
    "application/json; charset=utf-8",
    "Application/JSON;charset=UTF-8",
    "application/vnd.example+json",
]
NON_JSON_TYPES = [
    None,  # no Content-Type at all: a web page can send that without a CORS preflight
    "text/plain",
    "text/plain; charset=utf-8",
    "application/x-www-form-urlencoded",  # what curl -d sends
    "multipart/form-data; boundary=fuzz",
    "text/json",
    "application/jsonp",
    "application/xml",
    "application/octet-stream",
    "garbage",
    "application/",
    "*/*",
    ";;;",
]


def multipart(raw: bytes) -> bytes:
    """`raw` as the one field of a multipart/form-data body with the boundary "fuzz"."""
    return b'--fuzz\r\nContent-Disposition: form-data; name="body"\r\n\r\n' + raw + b"\r\n--fuzz--\r\n"


def as_sent(raw: bytes, content_type: str | None) -> bytes:
    return multipart(raw) if content_type and content_type.startswith("multipart/") else raw


def typed(content_type: str | None) -> dict[str, str]:
    return {} if content_type is None else {"content_type": content_type}


@pytest.mark.parametrize("path", [*BODY_ROUTES, "/ping"])
def test_any_content_type_is_answered_without_a_server_error(http, served, path):
    require(path, served)
    valid = dumps(VALID.get(path, {}))
    for content_type in [*JSON_TYPES, *NON_JSON_TYPES, ""]:
        for raw in (valid, b"", b"{", b"a=1&b=%7B%7D", multipart(valid)):
            r, payload = send(http, "POST", path, raw, **typed(content_type))
            assert_answered(path, r, payload, (content_type, raw[:100]))


@pytest.mark.parametrize("path", BODY_ROUTES)
def test_json_content_types_are_accepted(http, served, path):
    require(path, served)
    for content_type in JSON_TYPES:
        r, payload = send(http, "POST", path, dumps(VALID[path]), **typed(content_type))
        assert r.status_code == 200, (path, content_type, r.status_code, payload[:300])


@pytest.mark.parametrize("path", BODY_ROUTES)
def test_non_json_content_types_are_415(http, served, path):
    """A valid JSON body under any other content type is a 415 in the route's format that says what to send."""
    require(path, served)
    for content_type in NON_JSON_TYPES:
        r, payload = send(http, "POST", path, as_sent(dumps(VALID[path]), content_type), **typed(content_type))
        assert r.status_code == 415, (path, content_type, r.status_code, payload[:300])
        assert "application/json" in assert_error_format(path, payload)["message"], payload[:300]


# ---- framing that lies: raw sockets, on a server of their own ------------------------------------------------


@pytest.fixture(scope="module")
def framing_server(start_server):
    """A server of its own for requests whose framing lies: what they do to a server is seen on it alone."""
    return start_server("--num-kv-blocks", "16", "--max-request-body-mb", "1")


def request_head(path: str, *lines: str) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: fuzz", "Content-Type: application/json", "Connection: close", *lines]
    return ("\r\n".join(head) + "\r\n\r\n").encode()


def exchange(server, request: bytes, timeout: float = 10) -> tuple[int | None, bytes]:
    """Send `request` on a new connection and half-close it; -> (the answer's status, or None when the server
    closed without answering; the answer's body). Fails when neither comes within `timeout` seconds."""
    answer = b""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        try:
            sock.sendall(request)
            sock.shutdown(socket.SHUT_WR)
            while part := sock.recv(65536):
                answer += part
        except TimeoutError:
            pytest.fail(f"neither an answer nor a close within {timeout} s of sending {request[:300]!r}")
        except (ConnectionResetError, BrokenPipeError):
            pass
    if not answer:
        return None, b""
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split(b" ")[1]), rest.partition(b"\r\n\r\n")[2]


def server_damage(server, settle: float = 0.0) -> tuple[dict, int]:
    """(5xx counted in /metrics, tracebacks in the log): what a test must leave as it found it. `settle`:
    seconds to wait first, for the handler of a request whose client has gone to finish."""
    time.sleep(settle)
    return server.server_errors(), server.log().count("Traceback")


@pytest.mark.parametrize("path", BODY_ROUTES)
def test_a_body_shorter_than_its_content_length_is_no_server_error(framing_server, path):
    """The client declares 100 bytes more than it sends, then closes its side: a 4xx or a closed
    connection, and the server counts no 5xx and logs no traceback."""
    before = server_damage(framing_server)
    raw = dumps(VALID[path])
    status, body = exchange(framing_server, request_head(path, f"Content-Length: {len(raw) + 100}") + raw)
    assert status is None or 400 <= status < 500, (status, body[:300])
    assert server_damage(framing_server, settle=0.3) == before, framing_server.log()[-3000:]


def framings(raw: bytes) -> dict[str, tuple[list[str], bytes, set]]:
    """name -> (head lines, body, the statuses it may get: None is a close without an answer)."""
    n = len(raw)
    return {
        "longer than declared": ([f"Content-Length: {n - 5}"], raw, {400}),
        "declared over the limit": ([f"Content-Length: {10**12}"], raw, {413}),
        "a 300-digit length": ([f"Content-Length: {10**300}"], raw, {400, 413}),
        "not a number": (["Content-Length: abc"], raw, {400}),
        "negative": (["Content-Length: -1"], raw, {400}),
        "empty": (["Content-Length: "], raw, {400}),
        "signed": (["Content-Length: +5"], raw, {400}),
        "two lengths": ([f"Content-Length: {n}", "Content-Length: 3"], raw, {400}),
        "length and chunked": ([f"Content-Length: {n}", "Transfer-Encoding: chunked"], raw, {400, None}),
        "bad chunks": (["Transfer-Encoding: chunked"], b"zz\r\n" + raw, {400, None}),
        "unknown transfer coding": (["Transfer-Encoding: gzip"], raw, {400}),
    }


@pytest.mark.parametrize("path", [COMPLETIONS, MESSAGES])
@pytest.mark.parametrize("framing", list(framings(b"")))
def test_malformed_framing_is_4xx(framing_server, path, framing):
    before = server_damage(framing_server)
    lines, body, statuses = framings(dumps(VALID[path]))[framing]
    status, answer = exchange(framing_server, request_head(path, *lines) + body)
    assert status in statuses, (framing, status, answer[:300])
    if status in (413, 415) or (status == 400 and framing == "longer than declared"):  # the route answered
        assert_error_format(path, answer)
    assert server_damage(framing_server, settle=0.3) == before, framing_server.log()[-3000:]


def test_a_stalled_body_holds_up_no_one_else(framing_server):
    """A body that stops arriving (the connection stays open) delays no other request; when its client
    leaves, the server counts no 5xx and logs no traceback."""
    before = server_damage(framing_server)
    raw = dumps(VALID[CHAT])
    with socket.create_connection(("127.0.0.1", framing_server.port), timeout=TIMEOUT) as stalled:
        stalled.sendall(request_head(CHAT, f"Content-Length: {len(raw) + 100}") + raw)
        with httpx.Client(base_url=framing_server.url, timeout=TIMEOUT, headers={"Connection": "close"}) as client:
            assert client.get("/health").status_code == 200
            r = client.post(CHAT, json=VALID[CHAT])
            assert r.status_code == 200, r.text
    assert server_damage(framing_server, settle=0.3) == before, framing_server.log()[-3000:]


# ---- last -----------------------------------------------------------------------------------------------------


def test_server_healthy_after_http_fuzzing(server, http):
    assert_healthy_after_fuzzing(server, http)
