"""SIGTERM with a stream in flight: the server stops accepting connections at once, lets the in-flight
request finish normally, and exits with status 0 within --shutdown-grace-period."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx

MODEL = "deepinfer-demo-deepseek-v4-random"
GRACE = 30
MAX_TOKENS = 200


def refuses_connections(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        try:
            s.connect(("127.0.0.1", port))
        except (TimeoutError, ConnectionRefusedError):
            return True
        return False


def test_sigterm_finishes_in_flight_stream_and_exits_0(start_server):
    server = start_server("--num-kv-blocks", "16", "--shutdown-grace-period", str(GRACE))
    payloads: list[str] = []
    finished_at: list[float] = []
    failures: list[BaseException] = []
    first_events = threading.Event()

    def stream() -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        try:
            with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=GRACE) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        payloads.append(line.removeprefix("data: "))
                        if len(payloads) == 3:
                            first_events.set()
        except BaseException as err:  # reported by the test thread
            failures.append(err)
        finally:
            finished_at.append(time.monotonic())
            first_events.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first_events.wait(30) and not failures, failures
    assert not finished_at, "the stream ended before the signal: raise MAX_TOKENS"
    signalled = time.monotonic()
    server.process.send_signal(signal.SIGTERM)

    # shutdown began: new connections are refused while the stream is still being served
    deadline = signalled + 5
    while not refuses_connections(server.port):
        assert time.monotonic() < deadline, "the server still accepts connections 5 s after SIGTERM"
        time.sleep(0.02)
    refused_at = time.monotonic()
    assert not finished_at or finished_at[0] > refused_at, "the stream ended before the listener closed"

    reader.join(GRACE + 10)
    assert not reader.is_alive() and not failures, failures
    # the in-flight request completed normally
    assert payloads[-1] == "[DONE]"
    last = json.loads(payloads[-2])
    assert last["usage"]["completion_tokens"] == MAX_TOKENS
    assert [c for c in map(json.loads, payloads[:-1]) if c["choices"] and c["choices"][0]["finish_reason"]][-1][
        "choices"
    ][0]["finish_reason"] == "length"
    assert len(payloads) >= MAX_TOKENS // 2  # every token streamed, not a truncated reply

    returncode = server.process.wait(GRACE + 10)
    exited_after = time.monotonic() - signalled
    assert returncode == 0, server.log()
    assert exited_after < GRACE
    assert "server stopped" in server.log()
    server.assert_no_tracebacks()
