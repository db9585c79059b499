"""uvicorn's HTTP/1.1 (h11) protocol with the limits it lacks: a deadline for a request's head, a longest
pause within its body, and a cap on open connections.

uvicorn closes an idle connection only after a response (--timeout-keep-alive): a connection that never
sends a request, or sends it a byte at a time, would hold its socket for ever, and enough of them run
the process out of file descriptors. Here every connection must deliver its request line and headers
within `header_timeout` seconds of its first byte being awaited (408 and close otherwise), and a body
may pause at most `body_timeout` seconds between two parts (408; the handler sees a disconnect). A
connection beyond `max_connections` is answered 503 and closed at once, before it costs anything more.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["HttpLimits", "READ_TIMED_OUT", "guarded_protocol"]

log = logging.getLogger("deepinfer.serve")

# set in a request's ASGI scope when its body stopped arriving: the handler logs 408, not a client abort
READ_TIMED_OUT = "deepinfer.read_timed_out"


@dataclass(frozen=True, slots=True)
class HttpLimits:
    header_timeout: float  # seconds for a request's line and headers
    body_timeout: float  # longest pause between two parts of a body
    max_connections: int  # open connections; more are answered 503


def _raw_response(status: int, reason: str, message: str, extra: str = "") -> bytes:
    """A whole HTTP/1.1 response that closes the connection, with an OpenAI-format error body."""
    kind = "timeout" if status == 408 else "server_overloaded"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": kind}}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        f"connection: close\r\n{extra}\r\n"
    )
    return head.encode() + body


class _GuardedH11Protocol(H11Protocol):
    limits: HttpLimits  # set by guarded_protocol

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            message = (
                f"the server has {self.limits.max_connections} open connections, its limit "
                "(--limit-concurrency); retry shortly"
            )
            transport.write(_raw_response(503, "Service Unavailable", message, "retry-after: 1\r\n"))
            transport.close()
            return
        self._arm(self.limits.header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._after_read()

    def on_response_complete(self) -> None:
        self._disarm()  # the keep-alive timer takes over until the next request's first byte
        super().on_response_complete()

    def _after_read(self) -> None:
        if self.transport.is_closing():
            return
        theirs = self.conn.their_state
        if theirs is h11.IDLE:  # the next request's head is on its way: its deadline stands
            if self._read_timer is None:
                self._arm(self.limits.header_timeout)
        elif theirs is h11.SEND_BODY:  # each part of a body restarts the pause clock
            self._arm(self.limits.body_timeout)
        else:  # the request is in (or the connection is done with): the handler's time now
            self._disarm()

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(seconds, self._read_timed_out)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        if self.flow is not None and self.flow.read_paused:  # we stopped reading, not the client
            self._arm(self.limits.body_timeout)
            return
        in_body = self.conn.their_state is h11.SEND_BODY and self.cycle is not None
        if in_body:
            what, limit = "the request body", "--timeout-request-body"
            seconds = self.limits.body_timeout
        else:
            what, limit = "the request line and headers", "--timeout-request-header"
            seconds = self.limits.header_timeout
        idle_connection = self.conn.their_state is h11.IDLE and not self.conn.trailing_data[0]
        if in_body:
            self.cycle.scope[READ_TIMED_OUT] = True  # type: ignore[index]
            if not self.cycle.response_started:
                message = f"{what} did not arrive within {seconds:g} s ({limit}); send it faster"
                self.transport.write(_raw_response(408, "Request Timeout", message))
            self.cycle.disconnected = True
            self.cycle.message_event.set()  # the handler's wait for the body ends in a disconnect
        elif not idle_connection:  # a head begun but not finished: say why before closing
            message = f"{what} did not arrive within {seconds:g} s ({limit}); send it faster"
            self.transport.write(_raw_response(408, "Request Timeout", message))
        self.transport.close()


def guarded_protocol(limits: HttpLimits) -> type[H11Protocol]:
    """The protocol class to give uvicorn.Config(http=...)."""
    return type("GuardedH11Protocol", (_GuardedH11Protocol,), {"limits": limits})
