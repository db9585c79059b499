"""The front's channel from its rank processes on this host: a pipe per rank (parallel/data_parallel.py).

A rank killed halfway through a message ends only its own pipe, which the front then reads as EOF; with one queue
shared by every rank, the front would wait for the rest of that message for ever.
"""

from __future__ import annotations

import queue
import socket
import time

__all__ = ["PipeOutbox", "RankPipes", "free_port"]


class PipeOutbox:
    """A rank's end of its pipe to the front, with the queue's `put`."""

    def __init__(self, writer) -> None:
        self.writer = writer

    def put(self, message) -> None:
        self.writer.send(message)


class RankPipes:
    """The front's ends of the ranks' pipes, read as one queue (`get`, `get_nowait`, raising queue.Empty). A pipe
    whose rank ended (EOF) is dropped; the front learns of the rank's end from its process."""

    def __init__(self, readers: list) -> None:
        self._readers = list(readers)

    def get(self, timeout: float | None = None):
        from multiprocessing.connection import wait

        deadline = None if timeout is None else time.monotonic() + timeout
        while self._readers:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            for reader in wait(self._readers, left):
                try:
                    return reader.recv()
                except (EOFError, OSError):
                    self._readers.remove(reader)
                    reader.close()
            if deadline is not None and time.monotonic() >= deadline:
                break
        if not self._readers and timeout:
            time.sleep(min(timeout, 0.05))  # every rank ended: let the caller notice, without spinning
        raise queue.Empty

    def get_nowait(self):
        return self.get(timeout=0.0)

    def close(self) -> None:
        for reader in self._readers:
            reader.close()
        self._readers = []


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` (an address of this machine) now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
