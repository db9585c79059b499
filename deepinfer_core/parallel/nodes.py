"""Engine ranks on several nodes: the front's queues served over TCP, and the headless nodes that join them.

vLLM's multi-node data parallelism, in its spelling: the head node runs `deepinfer serve --data-parallel-size N
--data-parallel-size-local L --data-parallel-address HEAD --data-parallel-rpc-port P` (the API server and ranks
0..L-1); every other node runs `deepinfer serve --headless --data-parallel-size N --data-parallel-size-local L
--data-parallel-start-rank K --data-parallel-address HEAD --data-parallel-rpc-port P` (ranks K..K+L-1, no API
server). Chosen over torchrun: torchrun's rendezvous makes a world of the processes it launches, but the ranks
must join the head's world and its request queues, which the head defines.

The transport is Python's own `multiprocessing.managers` (a manager serving the front's queues at HEAD:P,
authenticated with $DEEPINFER_DATA_PARALLEL_KEY, required unless HEAD is loopback; it exchanges pickles, so P
must be reachable only from the cluster's nodes); torch.distributed's rendezvous is at HEAD:P+1. A headless node
reads the engine's settings (model, dtype, ...) from the head, so both need only agree on the flags above.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from multiprocessing.managers import BaseManager

from deepinfer_core.errors import DeepInferError

__all__ = ["Hub", "HubLink", "serve_headless"]

log = logging.getLogger(__name__)

KEY_ENV = "DEEPINFER_DATA_PARALLEL_KEY"
CONNECT_TIMEOUT_S = 600.0  # a headless node waiting for the head to come up


def _authkey() -> bytes:
    return os.environ.get(KEY_ENV, "deepinfer-data-parallel").encode()


class _Manager(BaseManager):
    pass


class Hub:
    """The front's side: one inbox per rank, one outbox, and the settings every rank builds its engine with,
    served at (host, port). The front uses the queues directly; ranks reach them through a HubLink."""

    def __init__(self, host: str, port: int, size: int, config: dict) -> None:
        if KEY_ENV not in os.environ and host not in ("127.0.0.1", "localhost", "::1"):
            raise DeepInferError(f"set ${KEY_ENV} to a secret shared by every node: the ranks' queues at {host}:{port} "
                                 "exchange pickles, which nobody else may send")  # fmt: skip
        self.inboxes = [queue.Queue() for _ in range(size)]
        self.outbox: queue.Queue = queue.Queue()
        inboxes, outbox = self.inboxes, self.outbox

        class Served(BaseManager):
            pass

        Served.register("inbox", callable=lambda rank: inboxes[rank])
        Served.register("outbox", callable=lambda: outbox)
        Served.register("config", callable=lambda: dict(config))
        try:
            self._server = Served(address=(host, port), authkey=_authkey()).get_server()
        except OSError as err:
            raise DeepInferError(f"cannot serve the ranks' queues at {host}:{port} ({err}); choose another "
                                 "--data-parallel-rpc-port or --data-parallel-address") from None  # fmt: skip
        threading.Thread(target=self._server.serve_forever, name="deepinfer-dp-hub", daemon=True).start()


@dataclass(frozen=True, slots=True)
class HubLink:
    """How a rank process reaches the front's queues (picklable: given to a rank process in place of them)."""

    host: str
    port: int
    rank: int

    def connect(self, timeout_s: float = CONNECT_TIMEOUT_S) -> _Manager:
        _Manager.register("inbox")
        _Manager.register("outbox")
        _Manager.register("config")
        deadline = time.monotonic() + timeout_s
        while True:
            manager = _Manager(address=(self.host, self.port), authkey=_authkey())
            try:
                manager.connect()
                return manager
            except (ConnectionRefusedError, OSError) as err:
                if time.monotonic() > deadline:
                    raise DeepInferError(f"the head node's data-parallel port {self.host}:{self.port} did not "
                                         f"answer within {timeout_s:.0f} s ({err})") from None  # fmt: skip
                time.sleep(0.5)

    def queues(self):
        """(this rank's inbox, the outbox) as proxies."""
        manager = self.connect()
        return manager.inbox(self.rank), manager.outbox()


def serve_headless(host: str, port: int, size: int, start_rank: int, local_size: int) -> int:
    """A node without the API server: start ranks start_rank .. start_rank + local_size - 1 of the head's world
    (on this node's devices 0 .. local_size - 1) and wait until they end. Returns the exit status."""
    import multiprocessing

    from deepinfer_core.parallel.rank_process import rank_main

    if not 0 < start_rank < size or start_rank + local_size > size:
        raise DeepInferError(f"--data-parallel-start-rank {start_rank} with --data-parallel-size-local {local_size} "
                             f"is not a part of a world of {size} ranks after the head's")  # fmt: skip
    config = HubLink(host, port, start_rank).connect().config()._getvalue()
    if config["size"] != size:
        raise DeepInferError(f"the head runs {config['size']} ranks, this node was told {size}: give both the same "
                             "--data-parallel-size")  # fmt: skip
    log.info("joining the head at %s:%d as ranks %d-%d of %d", host, port, start_rank, start_rank + local_size - 1,
             size)  # fmt: skip
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(
            target=rank_main,
            args=(
                rank,
                size,
                rank - start_rank,
                config["dist_address"],
                config["options"],
                config["expert_parallel"],
                config["eplb"],
                HubLink(host, port, rank),
                None,
            ),  # fmt: skip
            name=f"deepinfer-rank-{rank}",
        )
        for rank in range(start_rank, start_rank + local_size)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    codes = [p.exitcode for p in processes]
    log.info("ranks %d-%d ended (exit codes %s)", start_rank, start_rank + local_size - 1, codes)
    return 0 if all(code == 0 for code in codes) else 1
