"""The server's listening socket and the uvicorn server that serves on it.

The socket is bound (and listening) before the model loads, as vLLM does, so that a busy port fails in a
second rather than after minutes of loading; "listening on ..." is logged only once uvicorn accepts
connections on it.

On SIGTERM, uvicorn stops accepting and waits for in-flight requests. When --shutdown-grace-period runs
out first, `on_grace_expired` ends them (each stream gets its protocol's error event and a proper end),
and uvicorn's own hard stop comes a few seconds later, only as a backstop. Errors the event loop reports
outside any request (a failing accept() when file descriptors run out) are logged at most once per
interval, with a count, instead of once per attempt.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import socket
import time
from collections.abc import Callable

import uvicorn

from deepinfer_core.errors import DeepInferError

__all__ = ["ListeningServer", "bind", "default_connection_limit", "url"]

log = logging.getLogger("deepinfer.serve")

_BACKLOG = 2048  # uvicorn's default
_SPARE_FILES = 128  # descriptors kept for the model's files, logs and the engine beyond the connections
_HARD_STOP_AFTER_GRACE = 5.0  # seconds streams get to send their final events once the grace ran out
_LOOP_ERROR_INTERVAL = 10.0  # seconds between two log lines of the same event-loop error


def default_connection_limit() -> int:
    """Raise the open-file limit to its hard maximum (as vLLM does) and leave room beyond the connections
    for everything else the process opens: the default --limit-concurrency."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    soft = 65536 if soft == resource.RLIM_INFINITY else soft
    return max(16, soft - _SPARE_FILES)


def url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bind(host: str, port: int) -> socket.socket:
    """A socket listening on host:port, or one DeepInferError saying why not and what to do."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as err:
        raise DeepInferError(
            f"--host {host} is not an address of this machine ({err.strerror}): pass an IP address such as "
            "127.0.0.1 (this machine only) or 0.0.0.0 (all interfaces)"
        ) from None
    sock = socket.socket(family, kind, proto)
    # as uvicorn: a restarted server can bind at once while the old connections sit in TIME_WAIT. Unlike
    # SO_REUSEPORT, this still refuses a port another socket listens on.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(_BACKLOG)
    except OSError as err:
        sock.close()
        reason = err.strerror or str(err)
        if err.errno == errno.EADDRINUSE:
            raise DeepInferError(f"port {port} on {host} is in use ({reason}): pick another with --port") from None
        if err.errno == errno.EACCES:
            raise DeepInferError(
                f"cannot listen on port {port} on {host} ({reason}): ports below 1024 need privileges; "
                "pick another with --port"
            ) from None
        if err.errno == errno.EADDRNOTAVAIL:
            raise DeepInferError(
                f"--host {host} is not an address of this machine ({reason}): use 127.0.0.1, 0.0.0.0 or the "
                "address of one of its interfaces"
            ) from None
        raise DeepInferError(f"cannot listen on {host}:{port}: {reason}") from None
    return sock


class _LoopErrors:
    """An event-loop exception handler that logs each kind of error once per interval, with a count."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        err = context.get("exception")
        key = f"{context.get('message', '')}|{type(err).__name__}|{getattr(err, 'errno', '')}"
        now = time.monotonic()
        if now - self._last.get(key, -_LOOP_ERROR_INTERVAL) < _LOOP_ERROR_INTERVAL:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        self._last[key] = now
        again = self._suppressed.pop(key, 0)
        more = f" ({again} more like it in the last {_LOOP_ERROR_INTERVAL:g} s)" if again else ""
        if isinstance(err, OSError) and err.errno in (errno.EMFILE, errno.ENFILE):
            log.error(
                "%s: %s%s; too many open connections: lower --limit-concurrency or raise the open-file limit "
                "(ulimit -n)",
                context.get("message", "event loop error"),
                err.strerror,
                more,
            )
        elif isinstance(err, OSError):
            log.warning("%s: %s%s", context.get("message", "event loop error"), err, more)
        else:
            loop.default_exception_handler(context)
            if again:
                log.warning("%d more event-loop errors like the last were not logged", again)


class ListeningServer(uvicorn.Server):
    """A uvicorn server that calls `on_started()` once it accepts connections, and `on_grace_expired()`
    when in-flight requests outlast the shutdown grace period."""

    def __init__(
        self,
        config: uvicorn.Config,
        on_started: Callable[[], None],
        grace_period: float | None = None,
        on_grace_expired: Callable[[], None] | None = None,
    ) -> None:
        if grace_period is not None:  # the backstop: after ours has ended every request
            config.timeout_graceful_shutdown = int(grace_period + _HARD_STOP_AFTER_GRACE)
        super().__init__(config)
        self._on_started = on_started
        self._grace_period = grace_period
        self._on_grace_expired = on_grace_expired

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.get_running_loop().set_exception_handler(_LoopErrors())
        await super().startup(sockets=sockets)
        if self.started:
            self._on_started()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = None
        if self._grace_period is not None and self._on_grace_expired is not None:
            timer = asyncio.get_running_loop().call_later(self._grace_period, self._on_grace_expired)
        try:
            await super().shutdown(sockets=sockets)
        finally:
            if timer is not None:
                timer.cancel()
