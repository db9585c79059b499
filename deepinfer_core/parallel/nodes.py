"""Engine ranks on several nodes: the front's queues served over TCP, and the headless nodes that join them.

vLLM's multi-node data parallelism, in its spelling: the head node runs `deepinfer serve --data-parallel-size N
--data-parallel-size-local L --data-parallel-address HEAD --data-parallel-rpc-port P` (the API server and ranks
0..L-1); every other node runs `deepinfer serve --headless --data-parallel-size N --data-parallel-size-local L
--data-parallel-start-rank K --data-parallel-address HEAD --data-parallel-rpc-port P` (ranks K..K+L-1, no API
server). Chosen over torchrun: torchrun's rendezvous makes a world of the processes it launches, but the ranks
must join the head's world and its request queues, which the head defines.

The transport is Python's own `multiprocessing.managers` (a manager serving the front's queues at HEAD:P,
authenticated with $DEEPINFER_DATA_PARALLEL_KEY, required unless HEAD is loopback; it exchanges pickles, so P
must be reachable only from the cluster's nodes); torch.distributed's rendezvous is at HEAD:P+1, and after a
restart at a port the head picks. A headless node reads the engine's settings (model, dtype, ...) from the head,
so both need only agree on the flags above.

Each world the head starts is a generation with queues of its own (a rank of an old world cannot write into the
new one). A headless node is a supervisor of its rank processes: it says hello to the head (its first rank and
rank count), reports a rank process that ended without being asked, and takes the head's orders on a control
queue of its own: ("restart", generation, size, address, survivors) — stop its ranks and start those of its ranks
listed in `survivors` (the old ranks, in their new order) on the devices they had —, ("census", generation) —
answer with every rank's exit code so far (None: running), which the head asks of every node once a rank is lost
(a node's own report may come late; a node that does not answer is taken as gone, with its ranks) — or ("stop",).
A node stopped by a signal reports its ranks as ended before it stops them.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.managers import BaseManager

from deepinfer_core.errors import DeepInferError

__all__ = ["Hub", "HubLink", "restarted_ranks", "serve_headless"]

log = logging.getLogger(__name__)

KEY_ENV = "DEEPINFER_DATA_PARALLEL_KEY"
CONNECT_TIMEOUT_S = 600.0  # a headless node waiting for the head to come up
NODE_POLL_S = 0.1  # how often a headless node looks at its rank processes (the head waits 0.5 s for its word)
STOP_WAIT_S = 10.0  # a stopped rank's time to end before it is killed


def _authkey() -> bytes:
    return os.environ.get(KEY_ENV, "deepinfer-data-parallel").encode()


class _Manager(BaseManager):
    pass


_Manager.register("inbox")
_Manager.register("outbox")
_Manager.register("control")
_Manager.register("config")


class Hub:
    """The front's side: per generation (one world of ranks) one inbox per rank and one outbox; per headless
    node a control queue; the settings every rank builds its engine with. Served at (host, port). The front
    uses the queues directly; ranks and nodes reach them through a HubLink."""

    def __init__(self, host: str, port: int, config: dict) -> None:
        if KEY_ENV not in os.environ and host not in ("127.0.0.1", "localhost", "::1"):
            raise DeepInferError(f"set ${KEY_ENV} to a secret shared by every node: the ranks' queues at {host}:{port} "
                                 "exchange pickles, which nobody else may send")  # fmt: skip
        self._queues: dict[tuple, queue.Queue] = {}
        self._lock = threading.Lock()

        class Served(BaseManager):
            pass

        Served.register("inbox", callable=lambda generation, rank: self.queue("inbox", generation, rank))
        Served.register("outbox", callable=lambda generation: self.queue("outbox", generation))
        Served.register("control", callable=lambda node: self.queue("control", node))
        Served.register("config", callable=lambda: dict(config))
        try:
            self._server = Served(address=(host, port), authkey=_authkey()).get_server()
        except OSError as err:
            raise DeepInferError(f"cannot serve the ranks' queues at {host}:{port} ({err}); choose another "
                                 "--data-parallel-rpc-port or --data-parallel-address") from None  # fmt: skip
        threading.Thread(target=self._server.serve_forever, name="deepinfer-dp-hub", daemon=True).start()

    def queue(self, *key) -> queue.Queue:
        with self._lock:
            return self._queues.setdefault(key, queue.Queue())

    def world(self, generation: int, size: int) -> tuple[list[queue.Queue], queue.Queue]:
        """(the inboxes, the outbox) of generation `generation`'s `size` ranks; the older generations' dropped."""
        with self._lock:
            for key in [k for k in self._queues if k[0] != "control" and k[1] < generation]:
                del self._queues[key]
        return [self.queue("inbox", generation, rank) for rank in range(size)], self.queue("outbox", generation)


@dataclass(frozen=True, slots=True)
class HubLink:
    """How a rank process reaches the front's queues (picklable: given to a rank process in place of them)."""

    host: str
    port: int
    rank: int
    generation: int = 0

    def connect(self, timeout_s: float = CONNECT_TIMEOUT_S) -> _Manager:
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
        return manager.inbox(self.generation, self.rank), manager.outbox(self.generation)


def restarted_ranks(devices: dict[int, int], survivors: list[int]) -> dict[int, int]:
    """A node's ranks in a restarted world: {new rank: device} for each of its ranks (`devices`: old rank ->
    device) that `survivors` (the old ranks of the new world, in their new order) keeps."""
    return {survivors.index(old): device for old, device in sorted(devices.items()) if old in survivors}


class _Node:
    """A headless node's rank processes and what it knows of the head's world."""

    def __init__(self, key: int, host: str, port: int, config: dict) -> None:
        import multiprocessing

        self.key, self.host, self.port, self.config = key, host, port, config
        self.context = multiprocessing.get_context("spawn")
        self.processes: dict[int, object] = {}  # rank -> its process, in the current generation
        self.devices: dict[int, int] = {}  # rank -> this node's device it runs on
        self.generation = 0
        self.reported: set[int] = set()

    def start(self, generation: int, size: int, address: str, devices: dict[int, int]) -> None:
        from deepinfer_core.parallel.rank_process import rank_main

        self.generation, self.devices, self.reported = generation, devices, set()
        config = self.config
        self.processes = {
            rank: self.context.Process(
                target=rank_main,
                args=(
                    rank,
                    size,
                    device,
                    address,
                    config["options"],
                    config["expert_parallel"],
                    config["eplb"],
                    HubLink(self.host, self.port, rank, generation),
                    None,
                ),  # fmt: skip
                name=f"deepinfer-rank-{rank}",
            )
            for rank, device in devices.items()
        }
        for process in self.processes.values():
            process.start()
        if devices:
            log.info("generation %d: ranks %s of %d on devices %s", generation, sorted(devices), size,
                     [devices[r] for r in sorted(devices)])  # fmt: skip

    def ended_unasked(self) -> dict[int, int]:
        """{rank: exit code} of the rank processes that ended since the last call and not with 0 (a rank that
        fails with an error of its own says so to the head itself, then ends with 0)."""
        ended = {}
        for rank, process in self.processes.items():
            if rank not in self.reported and not process.is_alive():
                self.reported.add(rank)
                if process.exitcode != 0:
                    ended[rank] = process.exitcode
        return ended

    def exit_codes(self) -> dict[int, int | None]:
        """{rank: its process's exit code, None while it runs}."""
        return {rank: process.exitcode for rank, process in self.processes.items()}

    def stop(self, wait_s: float) -> list[int | None]:
        """Wait up to `wait_s` in all for the rank processes to end, then kill the rest; their exit codes."""
        deadline = time.monotonic() + wait_s
        for process in self.processes.values():
            if process.pid is None:  # never started (a signal during `start`)
                continue
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        return [p.exitcode for p in self.processes.values()]

    def report_gone(self, manager) -> None:
        """Tell the head that this node's running ranks are about to end (it is being stopped unasked). From a
        thread of its own: proxies share a connection per thread, and the signal may have cut a call on this
        thread's short, leaving its answer unread there."""

        def report() -> None:
            try:
                outbox = manager.outbox(self.generation)
                for rank, code in self.exit_codes().items():
                    if code is None:
                        outbox.put(("ended", rank, -signal.SIGTERM))
            except Exception:  # noqa: BLE001 - the head may be gone too: nothing to tell
                pass

        thread = threading.Thread(target=report, name="deepinfer-node-report", daemon=True)
        thread.start()
        thread.join(timeout=5.0)


def serve_headless(host: str, port: int, size: int, start_rank: int, local_size: int) -> int:
    """A node without the API server: start ranks start_rank .. start_rank + local_size - 1 of the head's world
    (on this node's devices 0 .. local_size - 1), then supervise them until the head says stop (or is gone):
    report a rank process that ends unasked, and start this node's part of each world the head restarts.
    Returns the exit status."""
    if not 0 < start_rank < size or start_rank + local_size > size:
        raise DeepInferError(f"--data-parallel-start-rank {start_rank} with --data-parallel-size-local {local_size} "
                             f"is not a part of a world of {size} ranks after the head's")  # fmt: skip
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the ranks (the finally below) on SIGTERM too
    manager = HubLink(host, port, start_rank).connect()
    config = manager.config()._getvalue()
    if config["size"] != size:
        raise DeepInferError(f"the head runs {config['size']} ranks, this node was told {size}: give both the same "
                             "--data-parallel-size")  # fmt: skip
    log.info("joining the head at %s:%d as ranks %d-%d of %d", host, port, start_rank, start_rank + local_size - 1,
             size)  # fmt: skip
    control = manager.control(start_rank)
    manager.outbox(0).put(("node", start_rank, local_size))
    node = _Node(start_rank, host, port, config)
    try:
        ranks = range(start_rank, start_rank + local_size)
        node.start(0, size, config["dist_address"], {rank: rank - start_rank for rank in ranks})
        return _supervise(node, manager, control)
    except BaseException:  # SIGTERM (SystemExit), Ctrl-C: the head learns of it before the ranks' peers fail
        node.report_gone(manager)
        raise
    finally:
        node.stop(wait_s=0.0)


def _supervise(node: _Node, manager, control) -> int:
    while True:
        ended = node.ended_unasked()
        if ended:
            log.error("rank(s) %s ended (exit codes %s)", sorted(ended), [ended[r] for r in sorted(ended)])
        try:
            for rank, code in ended.items():
                manager.outbox(node.generation).put(("ended", rank, code))
            message = control.get(timeout=NODE_POLL_S)
        except queue.Empty:
            continue
        except (EOFError, OSError) as err:  # ConnectionError is an OSError
            log.error("the head node is gone (%s); stopping this node's ranks", err)
            return 1
        if message[0] == "stop":
            codes = node.stop(STOP_WAIT_S)
            log.info("ranks %s ended (exit codes %s)", sorted(node.processes), codes)
            return 0
        if message[0] == "census":
            manager.outbox(message[1]).put(("census", node.key, node.exit_codes()))
            continue
        _, generation, size, address, survivors = message  # ("restart", ...)
        node.stop(wait_s=0.0)
        devices = restarted_ranks(node.devices, survivors)
        if not devices:
            log.error("no rank of this node is in the restarted world (its devices were lost); ending")
            return 1
        node.start(generation, size, address, devices)
