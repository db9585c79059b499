"""The server's listening socket and the uvicorn server that serves on it.

The socket is bound (and listening) before the model loads, as vLLM does, so that a busy port fails in a
second rather than after minutes of loading; "listening on ..." is logged only once uvicorn accepts
connections on it.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable

import uvicorn

from deepinfer_core.errors import DeepInferError

__all__ = ["ListeningServer", "bind", "url"]

_BACKLOG = 2048  # uvicorn's default


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


class ListeningServer(uvicorn.Server):
    """A uvicorn server that calls `on_started()` once it accepts connections."""

    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self._on_started()
