"""The engine's settings (what `deepinfer serve`'s flags and `LLM(...)`'s arguments set), checked on creation."""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer_core.engine.block_manager import PrefixReplay, check_prefix_replay
from deepinfer_core.engine.limits import at_least_one
from deepinfer_core.engine.scheduler import SchedulerConfig
from deepinfer_core.engine.speculative import SpeculativeConfig
from deepinfer_core.errors import DeepInferError

__all__ = ["EngineConfig"]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    num_kv_blocks: int | None = None  # None: size the cache from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 1 << 30
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    prefix_replay: PrefixReplay = "exact"  # a hit's replay of per-sequence caches: all of it, or one block
    # host memory for window snapshots at block boundaries (engine/snapshots.py); 0: none, hits replay
    window_snapshot_bytes: int = 4 << 30
    scheduler: SchedulerConfig = SchedulerConfig()
    async_scheduling: bool | None = None  # None: where the backend's capabilities say it supports it
    graph_batch_size: int = 256  # decode steps of up to this many sequences replay device graphs; 0: never
    seed: int | None = None  # seeds requests without one (vLLM's --seed); None: from system randomness
    speculative: SpeculativeConfig | None = None  # draft and verify (vLLM's --speculative-config); None: off

    def __post_init__(self) -> None:
        for name in ("num_kv_blocks", "kv_cache_memory_bytes", "max_model_len"):
            at_least_one(name, getattr(self, name))
        if self.window_snapshot_bytes < 0:
            raise DeepInferError(
                f"window_snapshot_bytes (--window-snapshot-gb) must be 0 (no snapshots) or more, "
                f"got {self.window_snapshot_bytes}"
            )
        check_prefix_replay(self.prefix_replay)
