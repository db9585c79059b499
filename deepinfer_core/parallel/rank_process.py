"""One engine rank's process (started by parallel/data_parallel.py's front): join the torch.distributed world,
build the engine, then step in lockstep with the other ranks and talk to the front over two queues.

Every iteration the ranks all-reduce whether any has work (and whether any was asked to stop) over a gloo group
of their own (the control plane; the MoE traffic goes over the backend's process-group kind). A rank with
nothing to run while others do runs an idle forward (parallel/lockstep.py). After each step it sends its
outputs with a RankReport (parallel/rank_reports.py).

Messages from the front: ("add", id, prompt, params), ("abort", id), ("stats",), ("stop",). To the front:
("ready", rank, info), ("failed", rank, reason), ("outputs", rank, outputs, report), ("rejected", rank, id,
reason), ("stats", rank, stats).
"""

from __future__ import annotations

import logging
import queue
import signal
import time
from datetime import timedelta

from deepinfer_core.errors import DeepInferError
from deepinfer_core.parallel.rank_admission import GrammarAdmission

__all__ = ["process_group_kind", "rank_main"]

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.002  # a rank with no work anywhere waits this long for requests between checks
CONTROL_TIMEOUT = timedelta(seconds=600)


def rank_main(rank: int, size: int, device: int, address: str, options: dict, expert_parallel: bool, eplb,
              inbox, outbox) -> None:  # fmt: skip
    """A rank process on the backend's device `device`: join the world, build the engine, then serve requests
    in lockstep with the others. inbox: a parallel/nodes.HubLink where the front's queues are served over TCP
    (outbox None then)."""
    import torch
    import torch.distributed as dist

    from deepinfer_core.parallel.nodes import HubLink

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the front's to handle (a drain), not each rank's
    if isinstance(inbox, HubLink):
        inbox, outbox = inbox.queues()

    try:
        from deepinfer_core.engine.llm import LLM
        from deepinfer_core.parallel.rank_reports import rank_info

        torch.set_num_threads(max(1, torch.get_num_threads() // size))  # the ranks share this host's cores
        kind = process_group_kind(options.get("accelerator")) if expert_parallel else "gloo"
        if kind != "gloo" and torch.accelerator.is_available():  # a device's collectives run on the rank's device
            torch.accelerator.set_device_index(device)
        dist.init_process_group(kind, init_method=address, rank=rank, world_size=size, timeout=CONTROL_TIMEOUT)
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT) if kind != "gloo" else None
        llm = LLM(**options, expert_parallel_rank=(rank, size, device) if expert_parallel else (0, 1, device))
        outbox.put(("ready", rank, rank_info(llm)))
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
    from deepinfer_core.model.layers import moe_layers
    from deepinfer_core.parallel.lockstep import MoELockstep
    from deepinfer_core.parallel.rank_reports import report_of

    lockstep = MoELockstep(engine.model) if expert_parallel else None
    engine.runner.lockstep = lockstep
    layers = moe_layers(engine.model)
    admission = GrammarAdmission(engine)
    stopping = False
    while True:
        stopping |= _drain(engine, inbox, outbox, rank, balancer, admission)
        for request_id, why in admission.admit():
            outbox.put(("rejected", rank, request_id, why))
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
        outbox.put(("outputs", rank, outputs, report_of(engine, layers)))


def _drain(engine, inbox, outbox, rank: int, balancer, admission: GrammarAdmission) -> bool:
    """Take every message waiting; True when asked to stop. A request with a structured-output grammar waits in
    `admission` until the grammar is compiled (off this loop: the ranks step in lockstep)."""
    while True:
        try:
            message = inbox.get_nowait()
        except queue.Empty:
            return False
        if message[0] == "stop":
            return True
        if message[0] == "abort":
            if not admission.abort(message[1]):
                engine.abort(message[1])
        elif message[0] == "stats":
            stats = {"rebalances": 0, "balancedness": []}
            if balancer is not None:
                stats = {"rebalances": balancer.rebalances, "balancedness": balancer.balancedness}
            outbox.put(("stats", rank, stats))
        elif message[0] == "add" and admission.needs(message[3]):
            admission.hold(*message[1:4])
        elif message[0] == "add":
            try:
                engine.add_request(message[1], message[2], message[3])
            except DeepInferError as err:
                outbox.put(("rejected", rank, message[1], str(err)))
