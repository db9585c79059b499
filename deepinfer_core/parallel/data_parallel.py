"""Attention data parallelism with expert parallelism: one engine process per rank, one front that feeds them.

Each rank runs its own engine (scheduler, KV cache, attention and the dense parts) on its own requests and
holds 1/N of the routed experts; the MoE layers dispatch and combine through the backend's communicator over
torch.distributed, so the ranks step in lockstep through them (parallel/lockstep.py): a rank with nothing to
run runs an idle forward. Every iteration the ranks all-reduce whether any has work, over a gloo group of
their own (the control plane; the MoE traffic goes over the backend's process-group kind).

The front (`DataParallelEngine`, what `LLM(data_parallel_size=N)` and the server hold instead of an `Engine`)
starts the ranks as processes, sends each request to the rank with the fewest requests, then the least KV
(the seeds' decode rule), and passes their outputs on. Requests and outputs travel over multiprocessing
queues; the ranks find each other through torch.distributed's TCP rendezvous on this host.

Not yet: several nodes, speculative decoding across ranks (a drafter's MoE layers would need the lockstep
too), device graphs across ranks, EPLB at runtime, restarting without a lost rank.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from deepinfer_core.errors import DeepInferError, RequestError

__all__ = ["DataParallelEngine"]

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # a rank loading its weights
IDLE_POLL_S = 0.002  # a rank with no work anywhere waits this long for requests between checks
CONTROL_TIMEOUT = timedelta(seconds=600)


@dataclass
class _RankLoad:
    requests: set[str] = field(default_factory=set)
    tokens: dict[str, int] = field(default_factory=dict)  # per request: prompt + output tokens known

    def key(self) -> tuple[int, int]:
        return len(self.requests), sum(self.tokens.values())


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class DataParallelEngine:
    """The front of `size` engine ranks: Engine's request interface (add_request, abort, step, has_unfinished).

    options: the LLM keyword arguments every rank builds its engine with (model, accelerator, dtype, ...).
    expert_parallel: the ranks split the routed experts (one expert-parallel world); else each holds them all."""

    def __init__(self, size: int, options: dict[str, Any], expert_parallel: bool = True, eplb=None) -> None:
        if size < 1:
            raise DeepInferError(f"data_parallel_size must be at least 1, got {size}")
        self.size = size
        context = multiprocessing.get_context("spawn")
        self._outbox = context.Queue()
        self._inboxes = [context.Queue() for _ in range(size)]
        address = f"tcp://127.0.0.1:{_free_port()}"
        self._processes = [
            context.Process(
                target=_rank_main,
                args=(rank, size, address, options, expert_parallel, eplb, self._inboxes[rank], self._outbox),
                name=f"deepinfer-rank-{rank}",
                daemon=True,
            )
            for rank in range(size)
        ]
        for process in self._processes:
            process.start()
        self._loads = [_RankLoad() for _ in range(size)]
        self._owner: dict[str, int] = {}
        self._rejected: list[tuple[str, str]] = []
        self._pending: list = []  # outputs that arrived while waiting for something else
        self.rank_info: list[dict] = [{}] * size
        self._wait_ready()

    def _wait_ready(self) -> None:
        ready, deadline = 0, time.monotonic() + START_TIMEOUT_S
        while ready < self.size:
            message = self._receive(deadline - time.monotonic())
            if message is None:
                self.shutdown()
                raise DeepInferError(f"the engine ranks did not start within {START_TIMEOUT_S:.0f} s")
            if message[0] == "ready":
                self.rank_info[message[1]] = message[2]
                ready += 1
            elif message[0] == "failed":
                self.shutdown()
                raise DeepInferError(f"engine rank {message[1]} could not start: {message[2]}")

    # ---- requests -------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | Sequence[int], params) -> None:
        if request_id in self._owner:
            raise RequestError(f"request id {request_id!r} is already in use")
        rank = min(range(self.size), key=lambda r: (*self._loads[r].key(), r))
        self._owner[request_id] = rank
        self._loads[rank].requests.add(request_id)
        # a text prompt's tokens are known once the rank reports; until then about 4 characters a token
        self._loads[rank].tokens[request_id] = len(prompt) if not isinstance(prompt, str) else len(prompt) // 4
        self._inboxes[rank].put(("add", request_id, prompt, params))

    def abort(self, request_id: str) -> None:
        rank = self._owner.pop(request_id, None)
        if rank is not None:
            self._forget(rank, request_id)
            self._inboxes[rank].put(("abort", request_id))

    def has_unfinished(self) -> bool:
        return bool(self._owner) or bool(self._rejected)

    def step(self, timeout_s: float = 0.05) -> list:
        """The outputs the ranks reported since the last call (waiting up to `timeout_s` for the first)."""
        outputs, self._pending = self._pending, []
        deadline = time.monotonic() + timeout_s
        message = self._receive(0.0 if outputs else timeout_s)
        while message is not None:
            outputs.extend(self._handle(message))
            message = self._receive(max(0.0, deadline - time.monotonic()) if not outputs else 0.0)
        if self._rejected:
            request_id, reason = self._rejected.pop(0)
            raise RequestError(f"request {request_id}: {reason}")
        return outputs

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
            kept = []
            for output in message[2]:
                if self._owner.get(output.request_id) != rank:
                    continue  # aborted since
                kept.append(output)
                load = self._loads[rank]
                load.tokens[output.request_id] = len(output.prompt_token_ids) + max(
                    (len(c.token_ids) for c in output.outputs), default=0
                )
                if output.finished:
                    del self._owner[output.request_id]
                    self._forget(rank, output.request_id)
            return kept
        if kind == "rejected":
            request_id = message[2]
            if self._owner.pop(request_id, None) is not None:
                self._forget(rank, request_id)
            self._rejected.append((request_id, message[3]))
            return []
        if kind == "failed":
            self.shutdown()
            raise DeepInferError(f"engine rank {rank} failed: {message[2]}")
        return []

    def _forget(self, rank: int, request_id: str) -> None:
        self._loads[rank].requests.discard(request_id)
        self._loads[rank].tokens.pop(request_id, None)

    def _receive(self, timeout_s: float):
        """The next message from the ranks, or None after `timeout_s`; an error if a rank process died."""
        try:
            return self._outbox.get(timeout=max(timeout_s, 0.0)) if timeout_s > 0 else self._outbox.get_nowait()
        except queue.Empty:
            dead = [p for p in self._processes if not p.is_alive()]
            if dead:
                codes = ", ".join(f"{p.name} (exit code {p.exitcode})" for p in dead)
                self.shutdown()
                raise DeepInferError(f"engine rank process ended: {codes}") from None
            return None

    def shutdown(self) -> None:
        """Stop every rank (idempotent)."""
        for inbox, process in zip(self._inboxes, self._processes):
            if process.is_alive():
                inbox.put(("stop",))
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # interpreter shutdown: nothing left to stop
            pass


# ---- the rank processes -------------------------------------------------------------------------


def _rank_main(rank: int, size: int, address: str, options: dict, expert_parallel: bool, eplb, inbox, outbox) -> None:
    """A rank process: join the world, build the engine, then serve requests in lockstep with the others."""
    import torch
    import torch.distributed as dist

    try:
        from deepinfer_core.engine.llm import LLM

        torch.set_num_threads(max(1, torch.get_num_threads() // size))  # the ranks share this host's cores
        kind = process_group_kind(options.get("accelerator")) if expert_parallel else "gloo"
        dist.init_process_group(kind, init_method=address, rank=rank, world_size=size, timeout=CONTROL_TIMEOUT)
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT) if kind != "gloo" else None
        llm = LLM(**options, expert_parallel_rank=(rank, size) if expert_parallel else None)
        path = getattr(llm, "model_path", None)
        info = {"backend": llm.backend.info.name, "model": llm.model_name, "path": None if path is None else str(path)}
        outbox.put(("ready", rank, info))
    except Exception as err:  # noqa: BLE001 - a rank that cannot start says why, then ends
        outbox.put(("failed", rank, f"{type(err).__name__}: {err}"))
        return
    try:
        balancer = None
        if eplb is not None:
            from deepinfer_core.model.layers import moe_layers
            from deepinfer_core.parallel.eplb_runtime import ExpertBalancer

            balancer = ExpertBalancer(moe_layers(llm.engine.model), eplb, rank, size, control)
        _serve(llm.engine, inbox, outbox, rank, control, expert_parallel, balancer, torch, dist)
    except Exception as err:  # noqa: BLE001
        log.exception("engine rank %d failed", rank)
        outbox.put(("failed", rank, f"{type(err).__name__}: {err}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def process_group_kind(accelerator: str | None) -> str:
    """The torch.distributed backend the selected backend's communicator runs on: its capabilities'
    "torch_distributed:<kind>" entry (gloo where it names none)."""
    from deepinfer_core.backend.registry import discover
    from deepinfer_core.backend.selection import select_backend

    entry = select_backend(discover(), accelerator)
    kinds = [c.split(":", 1)[1] for c in entry.capabilities.communicators if c.startswith("torch_distributed:")]
    return kinds[0] if kinds else "gloo"


def _serve(engine, inbox, outbox, rank: int, control, expert_parallel: bool, balancer, torch, dist) -> None:
    from deepinfer_core.parallel.lockstep import MoELockstep

    lockstep = MoELockstep(engine.model) if expert_parallel else None
    engine.runner.lockstep = lockstep
    stopping = False
    while True:
        stopping |= _drain(engine, inbox, outbox, rank, balancer)
        flags = torch.tensor([int(engine.has_unfinished()), int(stopping)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=control)
        if flags[1]:
            return
        if not flags[0]:  # no rank has work: wait a little for requests, then agree again
            time.sleep(IDLE_POLL_S)
            continue
        forwards = lockstep.forwards if lockstep else 0
        outputs = engine.step()
        if lockstep is not None and lockstep.forwards == forwards:
            lockstep.idle_forward()
        if balancer is not None:
            balancer.after_step()
        if outputs:
            outbox.put(("outputs", rank, outputs))


def _drain(engine, inbox, outbox, rank: int, balancer) -> bool:
    """Take every message waiting; True when asked to stop."""
    while True:
        try:
            message = inbox.get_nowait()
        except queue.Empty:
            return False
        if message[0] == "stop":
            return True
        if message[0] == "abort":
            engine.abort(message[1])
        elif message[0] == "stats":
            stats = {"rebalances": 0, "balancedness": []}
            if balancer is not None:
                stats = {"rebalances": balancer.rebalances, "balancedness": balancer.balancedness}
            outbox.put(("stats", rank, stats))
        elif message[0] == "add":
            try:
                engine.add_request(message[1], message[2], message[3])
            except DeepInferError as err:
                outbox.put(("rejected", rank, message[1], str(err)))
