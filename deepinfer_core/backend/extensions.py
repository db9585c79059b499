"""What general plugins (entry-point group `deepinfer.plugins`) contribute: logits processors,
request/step observers and model architectures. All are collected once when an engine is built."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["LogitsProcessor", "ModelRegistry", "Observer", "RequestEvent", "StepStats"]


@runtime_checkable
class LogitsProcessor(Protocol):
    def __call__(self, prompt_ids: Sequence[int], output_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """Return the (possibly modified) logits [V] of one request before sampling."""
        ...


@dataclass(frozen=True, slots=True)
class RequestEvent:
    request_id: str
    kind: str  # "arrived", "scheduled", "preempted", "finished", "aborted"
    detail: str = ""


@dataclass(frozen=True, slots=True)
class StepStats:
    step: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int


@runtime_checkable
class Observer(Protocol):
    """Sees requests and steps; must be quick and must not raise (errors are logged and ignored)."""

    def on_request(self, event: RequestEvent) -> None: ...

    def on_step(self, stats: StepStats) -> None: ...


class ModelRegistry:
    """Maps a checkpoint's `architectures` entry (e.g. "DeepseekV3ForCausalLM") to a model factory.

    A factory `(path, raw_config, backend, progress) -> model` returns what the engine runs: an object
    with `config` (vocab_size, max_position_embeddings, eos_token_ids), `cache_specs` (per layer, a dict
    name -> kv.layout.CacheSpec), `forward(token_ids, positions, meta, caches) -> hidden [T, D]` (caches:
    per layer, name -> tensor) and `logits(hidden) -> [N, V] float32`; optionally `graph_capture` (its
    decode steps may replay device graphs; default False) and `replay_tokens` (tokens recomputed before a
    prefix-cache hit to rebuild per-sequence caches; default 0).
    """

    def __init__(self) -> None:
        self._factories: dict[str, Callable[..., Any]] = {}

    def register(self, architecture: str, factory: Callable[..., Any]) -> None:
        if architecture in self._factories:
            raise ValueError(f"model architecture {architecture!r} is already registered")
        self._factories[architecture] = factory

    def get(self, architecture: str) -> Callable[..., Any]:
        try:
            return self._factories[architecture]
        except KeyError:
            known = ", ".join(sorted(self._factories)) or "none"
            raise KeyError(f"unknown model architecture {architecture!r}; registered: {known}") from None

    def architectures(self) -> list[str]:
        return sorted(self._factories)
