"""The multi-rank engine's restart after a lost rank (a part of parallel/data_parallel.py's front).

A lost rank takes its peers' collectives down with it and they report failing too, so the lost one is told apart
as the rank whose process ended without a word (killed, crashed): the front sees that of its own rank processes,
a headless node (parallel/nodes.py) reports it of its own. A rank that died without a word takes its device with
it: the world shrinks to the others, in their order (the head's ranks stay first, so rank 0, which hosts
torch.distributed's rendezvous, stays on the head), and the experts are placed over it. A rank that failed with
an error of its own keeps its device, and the requests it ran fail with that error instead of being sent again
(they may be what failed it). Every other request in flight is sent again from its prompt, at most MAX_RESENDS
times.
"""

from __future__ import annotations

import logging
import queue
import time

from deepinfer_core.errors import DeepInferError

__all__ = ["RankRecovery"]

log = logging.getLogger(__name__)

LOSS_SETTLE_S = 0.5  # after a rank fails or ends, how long the others (and the nodes) get to notice and report
CENSUS_TIMEOUT_S = 5.0  # how long a headless node has to say which of its ranks run before it is taken as gone
MAX_RESENDS = 2  # restarts a request may be sent again after, before it fails


class RankRecovery:
    """DataParallelEngine's restart: `_recover` after a lost rank, `_fatal` when none is left."""

    def _lost_ranks(self, failed: dict[int, str], ended: dict[int, int | str]) -> tuple[list[int], str, bool]:
        """(the lost ranks, why, whether their processes ended without a word), once one failed (`failed`: rank ->
        the reason it reported) or ended (`ended`: rank on another node -> exit code, as its node reported)."""
        time.sleep(LOSS_SETTLE_S)
        while True:
            try:
                message = self._outbox.get_nowait()
            except queue.Empty:
                break
            if message[0] == "failed":
                failed.setdefault(message[1], message[2])
            elif message[0] == "ended":
                ended.setdefault(message[1], message[2])
        for rank, process in enumerate(self._processes):
            if not process.is_alive():
                ended.setdefault(rank, process.exitcode)
        if self._node_ranks:
            self._census(failed, ended)
        # a rank whose process ended unasked (not with 0 after reporting a failure) or whose node is gone is lost,
        # whatever it reported first: a rank killed after its peer's loss broke its collective reports failing too
        silent = sorted(r for r, code in ended.items() if code != 0)
        if not silent and not failed:  # ended with 0 and said nothing: lost all the same
            silent = sorted(ended)
        if silent:
            codes = ", ".join(str(ended[r]) for r in silent)
            return silent, f"process ended without a word (exit code {codes})", True
        first = next(iter(failed))
        return [first], failed[first], False

    def _census(self, failed: dict[int, str], ended: dict[int, int | str]) -> None:
        """Ask every headless node for its ranks' exit codes (its own report of a rank that ended may not have
        come yet) and add those that ended to `ended`; the ranks of a node that does not answer within
        CENSUS_TIMEOUT_S (its machine down, its supervisor killed) count as ended with it."""
        waiting = set(self._node_ranks)
        for node in waiting:
            self._hub.queue("control", node).put(("census", self._generation))
        deadline = time.monotonic() + CENSUS_TIMEOUT_S
        while waiting and (left := deadline - time.monotonic()) > 0:
            try:
                message = self._outbox.get(timeout=left)
            except queue.Empty:
                break
            if message[0] == "census":
                waiting.discard(message[1])
                ended.update({r: code for r, code in message[2].items() if code not in (None, 0) and r not in ended})
            elif message[0] == "failed":
                failed.setdefault(message[1], message[2])
            elif message[0] == "ended":
                ended.setdefault(message[1], message[2])
        for node in waiting:
            log.error("headless node %d did not answer within %.0f s: taken as gone with its ranks %s", node,
                      CENSUS_TIMEOUT_S, self._node_ranks[node])  # fmt: skip
            for rank in self._node_ranks[node]:
                ended.setdefault(rank, "its node did not answer")

    def _recover(self, failed: dict[int, str], ended: dict[int, int] | None = None) -> None:
        """Restart after a lost rank (`_lost_ranks`): stop every rank process and start a world again (on every
        node), then send the requests in flight again from their prompts."""
        if self._failed is not None:
            return None
        started = time.monotonic()
        lost, reason, silent = self._lost_ranks(dict(failed), dict(ended or {}))
        survivors = [r for r in range(self.size) if r not in lost] if silent else list(range(self.size))
        devices = [d for rank, d in enumerate(self._devices) if rank not in lost] if silent else self._devices
        log.error("engine rank(s) %s lost: %s; restarting on %d rank(s)", lost, reason, len(survivors))
        self._stop_ranks(wait_s=0.0)  # the others may be blocked in a collective with the lost rank
        if not survivors:
            return self._fatal(f"every engine rank was lost (the last: {reason}); restart the server")
        if not devices:
            why = f"every engine rank on the head node was lost (the last: {reason})"
            return self._fatal(f"{why}; the head hosts the ranks' rendezvous: restart every node")
        held = {request_id for request_id, rank in self._owner.items() if rank in lost}
        for request_id in list(self._requests):
            self._resends[request_id] = self._resends.get(request_id, 0) + 1
            if (not silent and request_id in held) or self._resends[request_id] > MAX_RESENDS:
                self._fail(request_id, DeepInferError(f"an engine rank failed while running this request: {reason}"))
        self._devices, self._world, self._survivors = devices, len(survivors), survivors
        kept = {node: [survivors.index(r) for r in ranks if r in survivors] for node, ranks in self._node_ranks.items()}
        self._node_ranks = {node: ranks for node, ranks in kept.items() if ranks}  # a node left with none ends
        self._owner.clear()
        self._close_queues()
        self._generation += 1
        try:
            self._start()
        except DeepInferError as err:
            return self._fatal(f"the engine could not restart after losing rank(s) {lost}: {err}")
        for request_id, (prompt, params) in self._requests.items():
            self._send(request_id, prompt, params)
        seconds = time.monotonic() - started
        self.restarts.append({"lost": lost, "reason": reason, "world_size": self.size, "seconds": seconds,
                              "requeued": len(self._requests)})  # fmt: skip
        log.warning(
            "engine restarted with %d rank(s) in %.2f s; %d request(s) re-queued (recomputed from their prompts)",
            self.size, seconds, len(self._requests),
        )  # fmt: skip

    def _fatal(self, reason: str) -> None:
        """No rank is left to serve: every request in flight fails with `reason` (FailedRequests in the next
        step's outputs), and every new one is refused with it."""
        log.error("the engine cannot go on: %s", reason)
        self.shutdown(wait_s=0.0)
        self._failed = reason
        for request_id in list(self._requests):
            self._fail(request_id, DeepInferError(reason))
