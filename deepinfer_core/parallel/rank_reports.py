"""What the engine ranks tell the front between steps, and the front's summed view of them.

A rank sends a `RankReport` with its outputs (or alone when its state changed): the sequences its scheduler
runs and holds waiting, its KV cache's use and prefix-cache counters, the rows its experts computed per MoE
layer since its last report, and its structured-output mask times. The front keeps the last report of each
rank; `RanksScheduler` and `RanksBlocks` read them as one engine's scheduler and block manager (what the
server's admission limits and /metrics read), and `MoELoad` turns the rows into the moe_lb ratio.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

from deepinfer_core.engine.scheduler import SchedulerConfig

__all__ = ["Listed", "MoELoad", "RankReport", "RanksBlocks", "RanksScheduler", "rank_info", "report_of"]


@dataclass(frozen=True, slots=True)
class RankReport:
    running: tuple[str, ...] = ()  # request id of each running sequence
    waiting: tuple[str, ...] = ()
    num_used_blocks: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    expert_rows: tuple[int, ...] = ()  # per MoE layer: rows this rank's experts computed since the last report
    mask_seconds: tuple[float, ...] = ()  # structured-output mask samples since the last report


def rank_info(llm) -> dict:
    """What a rank says once it is up: its backend, model and the engine limits the server needs."""
    engine, backend = llm.engine, llm.backend
    path = llm.model_path
    return {
        "pid": os.getpid(),
        "backend": backend.info.name,
        "backend_description": backend.info.description,
        "device": backend.device.name,
        "model": llm.model_name,
        "path": None if path is None else str(path),
        "vocab_size": engine.model.config.vocab_size,
        "max_model_len": engine.max_model_len,
        "eos_token_ids": sorted(engine.eos_token_ids),
        "max_num_seqs": engine.scheduler.config.max_num_seqs,
        "num_blocks": engine.blocks.num_blocks,
        "block_size": engine.blocks.block_size,
        "enable_prefix_caching": engine.blocks.enable_prefix_caching,
    }


def report_of(engine, moe_layers: list) -> RankReport:
    """This rank's report now; the MoE layers' row counts and the mask samples start again from zero."""
    rows = tuple(layer.expert_rows for layer in moe_layers)
    for layer in moe_layers:
        layer.expert_rows = 0
    stats = engine.structured_stats
    masks = tuple(stats.drain()[1]) if stats is not None else ()
    blocks, scheduler = engine.blocks, engine.scheduler
    return RankReport(
        running=tuple(r.request_id for r in scheduler.running),
        waiting=tuple(r.request_id for r in scheduler.waiting),
        num_used_blocks=blocks.num_used_blocks,
        prefix_queries=blocks.prefix_queries,
        prefix_hits=blocks.prefix_hits,
        expert_rows=rows,
        mask_seconds=masks,
    )


@dataclass(frozen=True, slots=True)
class Listed:
    """A sequence a rank runs or holds, as the front knows it."""

    request_id: str


class RanksScheduler:
    """The ranks' schedulers as one: `config.max_num_seqs` summed, `running` / `waiting` as last reported."""

    def __init__(self, info: list[dict], reports: list[RankReport]) -> None:
        self.config = SchedulerConfig(max_num_seqs=sum(i["max_num_seqs"] for i in info))
        self._reports = reports

    @property
    def running(self) -> list[Listed]:
        return [Listed(i) for report in self._reports for i in report.running]

    @property
    def waiting(self) -> list[Listed]:
        return [Listed(i) for report in self._reports for i in report.waiting]


class RanksBlocks:
    """The ranks' KV caches as one (blocks summed, as last reported). A request runs on one rank, so the most
    KV one request can hold is `per_rank_tokens`, not num_blocks x block_size."""

    snapshots = None  # window snapshots are each rank's own: not summed

    def __init__(self, info: list[dict], reports: list[RankReport]) -> None:
        self.num_blocks = sum(i["num_blocks"] for i in info)
        self.block_size = info[0]["block_size"]
        self.enable_prefix_caching = info[0]["enable_prefix_caching"]
        self.per_rank_tokens = min(i["num_blocks"] for i in info) * self.block_size
        self._reports = reports

    @property
    def num_used_blocks(self) -> int:
        return sum(r.num_used_blocks for r in self._reports)

    @property
    def prefix_queries(self) -> int:
        return sum(r.prefix_queries for r in self._reports)

    @property
    def prefix_hits(self) -> int:
        return sum(r.prefix_hits for r in self._reports)


@dataclass
class MoELoad:
    """Rows each rank's experts computed per MoE layer, summed since the last `drain`: the moe_lb ratio (the
    slowest rank's rows over the mean; 1.0 is perfect balance) per layer, and over all layers the mean of
    theirs (as parallel/eplb.py's balancedness)."""

    rows: dict[int, list[int]] = field(default_factory=dict)  # rank -> rows per layer
    _lock: threading.Lock = field(default_factory=threading.Lock)  # added by the steps, drained by /metrics

    def add(self, rank: int, expert_rows: tuple[int, ...]) -> None:
        if not expert_rows:
            return
        with self._lock:
            held = self.rows.setdefault(rank, [0] * len(expert_rows))
            for layer, n in enumerate(expert_rows):
                held[layer] += n

    def drain(self, world_size: int) -> list[float] | None:
        """Each layer's moe_lb ratio since the last drain (ranks that computed nothing count as 0 rows), or
        None when no rows were computed."""
        with self._lock:
            rows, self.rows = self.rows, {}
        if not rows:
            return None
        layers = len(next(iter(rows.values())))
        ratios = []
        for layer in range(layers):
            loads = [rows.get(rank, [0] * layers)[layer] for rank in range(world_size)]
            mean = sum(loads) / world_size
            ratios.append(max(loads) / mean if mean else 1.0)
        return ratios
