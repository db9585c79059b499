"""EPLB while serving: count each MoE layer's tokens per expert, and every `step_interval` steps re-place the
experts (parallel/eplb.py) from the last `window_size` steps' counts and move their weights between the ranks.

Every rank runs this after every step of the lockstep (parallel/data_parallel.py), so all of them rebalance at
the same step: the counts are summed over the ranks (one all-reduce), every rank computes the same placement,
and one all-to-all per layer and weight (the backend communicator's `exchange`) carries each new slot's expert
from the lowest rank that holds it now.
The engine stops for no longer than that. Expert weights held quantized (BlockFP8 / MXFP4) move as their values
and scales.

vLLM's names for the settings (`--enable-eplb`, `--eplb-config` window_size / step_interval /
num_redundant_experts).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from deepinfer_core.errors import DeepInferError
from deepinfer_core.parallel.eplb import balance_ratio, rebalance
from deepinfer_core.parallel.expert_slots import ExpertSlots

__all__ = ["EplbConfig", "ExpertBalancer", "moved_weight"]

log = logging.getLogger(__name__)


# DeepSeek's published settings per phase (its EPLB of prefill and decode instances): redundant experts per rank,
# steps of counts a placement is computed from, steps between placements
PHASE_DEFAULTS = {
    "decode": {"redundant_per_rank": 1, "window_size": 1000, "step_interval": 10000},
    "prefill": {"redundant_per_rank": 4, "window_size": 100, "step_interval": 1000},
}


@dataclass(frozen=True, slots=True)
class EplbConfig:
    window_size: int = 1000  # steps of counts a placement is computed from
    step_interval: int = 10000  # steps between placements
    num_redundant_experts: int | None = None  # copies beyond one per expert (None: redundant_per_rank per rank)
    phase: str = "decode"  # whose defaults the unset keys take (PHASE_DEFAULTS)
    redundant_per_rank: int = 1

    @classmethod
    def parse(cls, raw: dict | None) -> EplbConfig:
        """vLLM's keys (window_size, step_interval, num_redundant_experts) and ours: phase, "decode" (the default)
        or "prefill", whose DeepSeek settings the keys not given take."""
        raw = dict(raw or {})
        unknown = sorted(set(raw) - {"window_size", "step_interval", "num_redundant_experts", "phase"})
        if unknown:
            raise DeepInferError(
                f"eplb_config has unknown keys {unknown}; it takes window_size, step_interval, "
                "num_redundant_experts, phase"
            )
        phase = raw.pop("phase", "decode")
        if phase not in PHASE_DEFAULTS:
            raise DeepInferError(f"eplb_config.phase must be one of {sorted(PHASE_DEFAULTS)}, got {phase!r}")
        config = cls(**{**PHASE_DEFAULTS[phase], **raw, "phase": phase})
        for name in ("window_size", "step_interval"):
            value = getattr(config, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DeepInferError(f"eplb_config.{name} must be a positive integer, got {value!r}")
        extra = config.num_redundant_experts
        if extra is not None and (isinstance(extra, bool) or not isinstance(extra, int) or extra < 0):
            raise DeepInferError(f"eplb_config.num_redundant_experts must be 0 or more, got {extra!r}")
        return config

    def redundant_experts(self, world_size: int) -> int:
        """Copies beyond one per expert, before rounding the slots up to a multiple of the ranks."""
        given = self.num_redundant_experts
        return self.redundant_per_rank * world_size if given is None else given


class ExpertBalancer:
    """One rank's side of EPLB over the MoE `layers` (model/layers.MoE, counting their tokens)."""

    def __init__(self, layers: list, config: EplbConfig, rank: int, world_size: int, control=None) -> None:
        """control: the ranks' gloo group for the counts (None: the default group, gloo too); the weights move
        through each layer's communicator (the backend's: its `exchange`)."""
        import torch.distributed as dist

        self.layers, self.config, self.rank, self.world_size = layers, config, rank, world_size
        self.control = control
        self._dist = dist
        experts = layers[0].routing.num_experts
        extra = config.redundant_experts(world_size)
        self.num_physical = -(-(experts + extra) // world_size) * world_size
        device = layers[0].gate.device
        self._window = torch.zeros((config.window_size, len(layers), experts), dtype=torch.int64, device=device)
        self.steps = 0
        self.rebalances = 0
        self.balancedness: list[float] = []  # moe_lb ratio of each placement on the window it came from
        for layer in layers:
            layer.load = torch.zeros(experts, dtype=torch.int64, device=device)

    def after_step(self) -> None:
        """Record this step's counts; re-place every step_interval steps."""
        slot = self.steps % self.config.window_size
        for i, layer in enumerate(self.layers):
            self._window[slot, i] = layer.load
            layer.load.zero_()
        self.steps += 1
        if self.steps % self.config.step_interval == 0:
            self.rebalance()

    def rebalance(self) -> None:
        started = time.perf_counter()
        counts = self._window.sum(dim=0).cpu()  # [L, E] this rank's
        self._dist.all_reduce(counts, group=self.control)  # every rank's
        placement = rebalance(counts, self.num_physical, 1, 1, self.world_size)
        for index, layer in enumerate(self.layers):
            slots = ExpertSlots.from_placement(placement, index, layer.gate.device)
            layer.w13 = moved_weight(layer.slots, slots, layer.w13, layer.comm)
            layer.w2 = moved_weight(layer.slots, slots, layer.w2, layer.comm)
            layer.slots = slots
        loads = placement.rank_loads(counts, self.world_size)
        self.balancedness.append(float(balance_ratio(loads).mean()))
        self.rebalances += 1
        log.info(
            "EPLB: experts re-placed at step %d in %.3f s (moe_lb on the window %.3f)",
            self.steps, time.perf_counter() - started, self.balancedness[-1],
        )  # fmt: skip


def moved_weight(old: ExpertSlots, new: ExpertSlots, local, comm):
    """This rank's stack of the `new` slots' expert weights, fetched through the layer's communicator (`exchange`)
    from the ranks whose `old` slots hold them: a plain tensor, or a quantized one (BlockFP8 / MXFP4: its values
    and scales moved alike)."""
    if isinstance(local, torch.Tensor):
        return _moved(old, new, local, comm)
    return replace(local, weight=_moved(old, new, local.weight, comm), scale=_moved(old, new, local.scale, comm))


def _moved(old: ExpertSlots, new: ExpertSlots, local: torch.Tensor, comm) -> torch.Tensor:
    """[S_new, ...] of the new slots' experts (each from the lowest rank whose old slots hold it; its first such
    slot), by one exchange of rows. One-byte floats (FP8 values, E8M0 scales) travel as bytes."""
    if local.element_size() == 1 and local.dtype != torch.uint8:
        return _moved(old, new, local.view(torch.uint8), comm).view(local.dtype)
    rank, world = comm.rank, comm.world_size
    old_per, new_per = old.num_physical // world, new.num_physical // world
    source = {}  # expert -> (rank, local index) it is taken from
    for slot, expert in enumerate(old.physical_to_logical):
        source.setdefault(expert, (slot // old_per, slot % old_per))
    new_experts = new.physical_to_logical
    sends = [[source[e][1] for e in new_experts[d * new_per : (d + 1) * new_per] if source[e][0] == rank]
             for d in range(world)]  # fmt: skip
    mine = new_experts[rank * new_per : (rank + 1) * new_per]
    receives = [sum(1 for e in mine if source[e][0] == s) for s in range(world)]
    send = torch.cat([local[torch.tensor(rows, dtype=torch.long)] for rows in sends]) if any(sends) else local[:0]
    received = comm.exchange(send, [len(rows) for rows in sends], receives)
    # received: from rank 0 its slots for me in my slot order, then rank 1's, ...
    starts = [sum(receives[:s]) for s in range(world)]
    taken = [0] * world
    order = []
    for expert in mine:
        s = source[expert][0]
        order.append(starts[s] + taken[s])
        taken[s] += 1
    return received[torch.tensor(order, dtype=torch.long)].contiguous()
