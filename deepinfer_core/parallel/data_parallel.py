"""Attention data parallelism with expert parallelism: one engine process per rank, one front that feeds them.

Each rank (parallel/rank_process.py) runs its own engine (scheduler, KV cache, attention and the dense parts) on
its own requests and holds 1/N of the routed experts; the MoE layers dispatch and combine through the backend's
communicator over torch.distributed, so the ranks step in lockstep through them (parallel/lockstep.py).

The front (`DataParallelEngine`, what `LLM(data_parallel_size=N)` and the server hold instead of an `Engine`)
starts the ranks as processes, sends each request to a rank by the seeds' rules (parallel/routing.py: the fewest
requests, then the least KV; long prompts spread by length bucket), and passes their outputs on. Requests and
outputs travel over multiprocessing queues; the ranks find each other through torch.distributed's TCP
rendezvous on this host. It reads as one engine to the server: `scheduler`, `blocks` (parallel/rank_reports.py),
`max_model_len`, `eos_token_ids`, `structured_compiler()`, `moe_lb_ratios()`.

A lost rank (its process killed, or failed) restarts the instance with the healthy ones: every rank process is
stopped, a world of the survivors (on their own devices) starts, the experts are placed over it afresh, and every
request in flight is sent again from its prompt with the seed it had (the front draws a seed for a request that
gives none, so the recomputed tokens are the same); what the client already received is not sent twice.

Across nodes (parallel/nodes.py) the same: each headless node is told which of its ranks make the new world, in
which order, and starts them on the devices they had. Not yet: speculative decoding across ranks (a drafter's MoE
layers would need the lockstep too), device graphs across ranks.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import random
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from deepinfer_core.engine.request import FailedRequest
from deepinfer_core.errors import DeepInferError, RequestError
from deepinfer_core.parallel.deliveries import Deliveries, DivergedRecomputation
from deepinfer_core.parallel.rank_pipes import PipeOutbox, RankPipes, free_port
from deepinfer_core.parallel.rank_process import rank_main
from deepinfer_core.parallel.rank_reports import MoELoad, RankReport, RanksBlocks, RanksScheduler
from deepinfer_core.parallel.restarts import RankRecovery
from deepinfer_core.parallel.routing import RankLoad, choose_rank

__all__ = ["DataParallelEngine", "start_ranks"]

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # a rank loading its weights


class DataParallelEngine(RankRecovery):
    """The front of `size` engine ranks: Engine's request interface (add_request, abort, step, has_unfinished).

    options: the LLM keyword arguments every rank builds its engine with (model, accelerator, dtype, ...).
    expert_parallel: the ranks split the routed experts (one expert-parallel world); else each holds them all.
    `tokenizer` (set by LLM): the served model's, for structured outputs' grammars (compiled here first)."""

    def __init__(self, size: int, options: dict[str, Any], expert_parallel: bool = True, eplb=None,
                 local_size: int | None = None, host: str = "127.0.0.1", port: int | None = None) -> None:  # fmt: skip
        """local_size < size: ranks local_size.. run on other nodes (parallel/nodes.py), which join the queues
        served at host:port (and torch.distributed's rendezvous at host:port+1)."""
        if size < 1:
            raise DeepInferError(f"data_parallel_size must be at least 1, got {size}")
        local_size = size if local_size is None else local_size
        if not 1 <= local_size <= size:
            raise DeepInferError(f"data_parallel_size_local must be 1 to {size}, got {local_size}")
        self._options, self._expert_parallel, self._eplb = options, expert_parallel, eplb
        self._devices = list(range(local_size))  # local rank r runs on the backend's device _devices[r]
        self._world = size
        self._hub = None
        if local_size < size:
            from deepinfer_core.parallel.nodes import Hub

            port = 29550 if port is None else port  # vLLM's --data-parallel-rpc-port default
            self._dist_address = f"tcp://{host}:{port + 1}"
            config = {"size": size, "dist_address": self._dist_address, "options": options,
                      "expert_parallel": expert_parallel, "eplb": eplb}  # fmt: skip
            self._hub, self._hub_address = Hub(host, port, config), (host, port)
        self._generation = 0  # worlds started before this one (a restart starts a new one)
        self._node_ranks: dict[int, list[int]] = {}  # headless node (its first rank at the start) -> its ranks now
        self._survivors: list[int] = []  # after a restart: the old world's ranks that make the new one, in order
        self._seeds = random.Random(options.get("seed"))
        self._requests: dict[str, tuple] = {}  # in flight: (prompt, params as sent)
        self._delivered = Deliveries()  # what was passed on of each request
        self._owner: dict[str, int] = {}
        self._pending: list = []  # outputs that arrived while waiting for something else, and FailedRequests
        self._moe_load = MoELoad()
        self.restarts: list[dict] = []  # one entry per restart after a lost rank
        self._failed: str | None = None  # why the instance cannot go on (`_fatal`), once it cannot
        self._resends: dict[str, int] = {}  # per request: times it was sent again after a restart
        self.tokenizer = None
        self._grammars = None
        self._processes: list = []
        self._start()
        info = self.rank_info[0]
        self.max_model_len, self._vocab_size = info["max_model_len"], info["vocab_size"]
        self.eos_token_ids = frozenset(info["eos_token_ids"])

    @property
    def size(self) -> int:
        """Ranks in the world (on every node)."""
        return self._world

    def _start(self) -> None:
        """Start a world of `size` ranks, one per device in `_devices` here (the others on their nodes), and wait
        until every rank is up."""
        context = multiprocessing.get_context("spawn")
        size = self.size
        if self._hub is None:
            # each rank writes to a pipe of its own: a rank killed halfway through a message ends only its pipe
            # (the front reads EOF), where a shared queue would leave the front waiting for the rest
            pipes = [context.Pipe(duplex=False) for _ in range(size)]
            self._outbox = RankPipes([reader for reader, _ in pipes])
            self._inboxes = [context.Queue() for _ in range(size)]
            address = f"tcp://127.0.0.1:{free_port()}"
            links = [(q, PipeOutbox(writer)) for q, (_, writer) in zip(self._inboxes, pipes)]
        else:
            from deepinfer_core.parallel.nodes import HubLink

            self._inboxes, self._outbox = self._hub.world(self._generation, size)
            host = self._hub_address[0]  # a restarted world meets at a port of its own (rank 0 is on this node)
            address = self._dist_address if self._generation == 0 else f"tcp://{host}:{_free_port(host)}"
            links = [(HubLink(*self._hub_address, rank, self._generation), None) for rank in range(len(self._devices))]
        self._processes = [
            context.Process(
                target=rank_main,
                args=(rank, size, device, address, self._options, self._expert_parallel, self._eplb, *links[rank]),
                name=f"deepinfer-rank-{rank}",
                daemon=True,
            )
            for rank, device in enumerate(self._devices)
        ]
        for process in self._processes:
            process.start()
        if self._hub is None:
            for _, outbox in links:
                outbox.writer.close()  # the rank holds it now; once the rank ends, its pipe reads EOF
        elif self._generation > 0:  # every headless node starts its part of the new world
            for node in self._node_ranks:
                self._hub.queue("control", node).put(("restart", self._generation, size, address, self._survivors))
        self._loads = [RankLoad() for _ in range(size)]
        self._reports = [RankReport() for _ in range(size)]
        self.rank_info: list[dict] = [{}] * size
        self._wait_ready()
        self.scheduler = RanksScheduler(self.rank_info, self._reports)
        self.blocks = RanksBlocks(self.rank_info, self._reports)

    def _wait_ready(self) -> None:
        ready, deadline = 0, time.monotonic() + START_TIMEOUT_S
        while ready < self.size:
            try:
                message = self._outbox.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in self._processes if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.shutdown()
                    why = f"{dead[0].name} ended (exit code {dead[0].exitcode})" if dead else "they took too long"
                    raise DeepInferError(f"the engine ranks did not start: {why}") from None
                continue
            if message[0] == "ready":
                self.rank_info[message[1]] = message[2]
                ready += 1
            elif message[0] == "failed":
                self.shutdown()
                raise DeepInferError(f"engine rank {message[1]} could not start: {message[2]}")
            elif message[0] == "ended":  # a rank process on another node
                self.shutdown()
                raise DeepInferError(f"engine rank {message[1]} ended while starting (exit code {message[2]})")
            elif message[0] == "node":  # a headless node's hello: its first rank and rank count
                self._node_ranks[message[1]] = list(range(message[1], message[1] + message[2]))

    # ---- one engine to the server -----------------------------------------------------------------

    def structured_compiler(self):
        """Structured outputs' grammar compiler (made at the first call): the server compiles a request's grammar
        here, off the ranks' lockstep, and refuses a bad one before it reaches a rank."""
        from deepinfer_core.structured import GrammarCompiler

        if self._grammars is None:
            if self.tokenizer is None:
                raise RequestError("structured outputs need the model's tokenizer; this engine was started without one")
            self._grammars = GrammarCompiler(self.tokenizer.to_json(), self._vocab_size, self.eos_token_ids)
        return self._grammars

    @property
    def structured_stats(self):
        """Grammar compile times (here) and the ranks' mask times, drained by the server's /metrics."""
        return self._grammars.stats if self._grammars is not None else None

    def moe_lb_ratios(self) -> list[float] | None:
        """Each MoE layer's moe_lb ratio (slowest rank's expert rows / the mean) since the last call; None when
        no MoE layer ran (parallel/rank_reports.MoELoad)."""
        return self._moe_load.drain(self.size)

    # ---- requests -------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | Sequence[int], params) -> None:
        if self._failed is not None:
            raise DeepInferError(self._failed)
        if request_id in self._owner:
            raise RequestError(f"request id {request_id!r} is already in use")
        if params.seed is None:  # a recomputed request (after a lost rank) must draw the same tokens again
            params = replace(params, seed=self._seeds.getrandbits(64))
        self._requests[request_id] = (prompt, params)
        self._send(request_id, prompt, params)

    def _send(self, request_id: str, prompt, params) -> None:
        # a text prompt's tokens are known once the rank reports; until then about 4 characters a token
        tokens = len(prompt) if not isinstance(prompt, str) else len(prompt) // 4
        rank = choose_rank(self._loads, tokens)
        self._owner[request_id] = rank
        self._loads[rank].add(request_id, tokens)
        self._inboxes[rank].put(("add", request_id, prompt, params))

    def abort(self, request_id: str) -> None:
        rank = self._owner.pop(request_id, None)
        self._requests.pop(request_id, None)
        self._delivered.forget(request_id)
        self._resends.pop(request_id, None)
        if rank is not None:
            self._forget(rank, request_id)
            self._inboxes[rank].put(("abort", request_id))

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._pending)

    def step(self, timeout_s: float = 0.05) -> list:
        """The outputs the ranks reported since the last call (waiting up to `timeout_s` for the first), and a
        FailedRequest for each request that ended without output (a rank refused it; it could not be recomputed)."""
        outputs, self._pending = self._pending, []
        deadline = time.monotonic() + timeout_s
        message = self._receive(0.0 if outputs else timeout_s)
        while message is not None:
            outputs.extend(self._handle(message))
            message = self._receive(max(0.0, deadline - time.monotonic()) if not outputs else 0.0)
        outputs.extend(self._pending)  # failures a restart reported meanwhile
        self._pending = []
        return outputs

    def _fail(self, request_id: str, error: Exception) -> None:
        """End `request_id` without output: a FailedRequest in the next step's outputs."""
        rank = self._owner.pop(request_id, None)
        if rank is not None:
            self._forget(rank, request_id)
        self._requests.pop(request_id, None)
        self._delivered.forget(request_id)
        self._resends.pop(request_id, None)
        self._pending.append(FailedRequest(request_id, error))

    def rank_stats(self, timeout_s: float = 60.0) -> list[dict]:
        """Each rank's EPLB statistics (rebalances so far, moe_lb of each placement on its window)."""
        for inbox in self._inboxes:
            inbox.put(("stats",))
        stats: list[dict | None] = [None] * self.size
        deadline = time.monotonic() + timeout_s
        while any(s is None for s in stats):
            message = self._receive(deadline - time.monotonic())
            if message is None:
                raise DeepInferError(f"the engine ranks did not report their statistics within {timeout_s:.0f} s")
            if message[0] == "stats":
                stats[message[1]] = message[2]
            else:
                self._pending.extend(self._handle(message))
        return stats

    def _handle(self, message: tuple) -> list:
        kind, rank = message[0], message[1]
        if kind == "outputs":
            self._reports[rank] = report = message[3]
            self._moe_load.add(rank, report.expert_rows)
            if report.mask_seconds and self._grammars is not None:
                self._grammars.stats.mask_seconds.extend(report.mask_seconds)
            kept = []
            for output in message[2]:
                if self._owner.get(output.request_id) != rank:
                    continue  # aborted since
                load = self._loads[rank]
                load.tokens[output.request_id] = len(output.prompt_token_ids) + max(
                    (len(c.token_ids) for c in output.outputs), default=0
                )
                if output.finished:
                    del self._owner[output.request_id]
                    self._requests.pop(output.request_id, None)
                    self._resends.pop(output.request_id, None)
                    self._forget(rank, output.request_id)
                if (output := self._undelivered(output)) is not None:
                    kept.append(output)
            return kept
        if kind == "rejected":
            if self._owner.get(message[2]) == rank:
                self._fail(message[2], RequestError(message[3]))
            return []
        if kind == "failed":
            self._recover({rank: message[2]})
        elif kind == "ended":  # a rank process on another node ended unasked (its node says so)
            self._recover({}, {rank: message[2]})
        return []

    def _undelivered(self, output):
        """`output` less what was passed on before (`Deliveries.new_part`); a recomputation that diverged from the
        tokens passed on fails its request."""
        try:
            return self._delivered.new_part(output)
        except DivergedRecomputation:
            self._fail(output.request_id, DeepInferError(
                "the engine lost a rank while running this request and its recomputation diverged from the "
                "tokens already sent; retry the request"))  # fmt: skip
            return None

    def _forget(self, rank: int, request_id: str) -> None:
        self._loads[rank].forget(request_id)

    def _receive(self, timeout_s: float):
        """The next message from the ranks, or None after `timeout_s`. A rank process that ended restarts the
        instance (`_recover`)."""
        if self._failed is not None:
            return None
        try:
            return self._outbox.get(timeout=max(timeout_s, 0.0)) if timeout_s > 0 else self._outbox.get_nowait()
        except queue.Empty:
            if any(not p.is_alive() for p in self._processes):
                self._recover({})
            return None

    def _close_queues(self) -> None:
        """Let go of a stopped world's queues (their pipes and feeder threads)."""
        if self._hub is not None:
            return  # the hub drops a generation's queues once the next starts
        for q in self._inboxes:
            q.cancel_join_thread()
            q.close()
        self._outbox.close()

    def shutdown(self, wait_s: float = 10.0) -> None:
        """Stop every rank (idempotent): asked to stop, then killed after `wait_s`; every headless node told to
        stop."""
        self._stop_ranks(wait_s)
        if getattr(self, "_hub", None) is not None:
            for node in self._node_ranks:
                self._hub.queue("control", node).put(("stop",))

    def _stop_ranks(self, wait_s: float) -> None:
        """Stop this node's rank processes: asked to stop (every rank: any may be gone), then killed after
        `wait_s`. A headless node's ranks stop with the others (they agree on stopping each step) or by its
        node's hand."""
        if wait_s > 0:  # one rank told is enough (the ranks agree on stopping each step), but any may be gone
            for rank, inbox in enumerate(getattr(self, "_inboxes", [])):
                if rank >= len(self._processes) or self._processes[rank].is_alive():
                    inbox.put(("stop",))
        for process in self._processes:
            process.join(timeout=wait_s)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # interpreter shutdown: nothing left to stop
            pass


def start_ranks(arguments: dict) -> DataParallelEngine:
    """The ranks `LLM(data_parallel_size=N, ...)` asks for (`arguments`: its keyword arguments): checked, then
    started, each building its engine from the rest of them."""
    from deepinfer_core.parallel.eplb_runtime import EplbConfig

    size, expert_parallel = arguments["data_parallel_size"], arguments["enable_expert_parallel"]
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise DeepInferError(f"data_parallel_size must be a positive integer, got {size!r}")
    if arguments["backend"] is not None or arguments["expert_parallel_rank"] is not None:
        raise DeepInferError("data_parallel_size > 1 starts its own ranks: pass neither backend nor a rank")
    if arguments["speculative_config"] is not None:
        raise DeepInferError(
            "speculative decoding does not run with data_parallel_size > 1 yet (a draft model's MoE layers "
            "would have to step with the other ranks'); drop speculative_config or run one rank"
        )
    skip = {"self", "data_parallel_size", "enable_expert_parallel", "expert_parallel_rank", "backend", "progress",
            "enable_eplb", "eplb_config", "data_parallel_size_local", "data_parallel_address",
            "data_parallel_rpc_port"}  # fmt: skip
    options = {k: v for k, v in arguments.items() if k not in skip and not k.startswith("__")}
    options.update(progress=False, graph_batch_size=0)  # no device graphs around the ranks' collectives
    eplb = EplbConfig.parse(arguments["eplb_config"]) if arguments["enable_eplb"] else None
    return DataParallelEngine(
        size, options, expert_parallel, eplb, arguments["data_parallel_size_local"],
        arguments["data_parallel_address"], arguments["data_parallel_rpc_port"],
    )  # fmt: skip


def _free_port(host: str) -> int:
    try:
        return free_port(host)
    except OSError as err:
        raise DeepInferError(f"no free port on {host} for the restarted ranks' rendezvous ({err})") from None
