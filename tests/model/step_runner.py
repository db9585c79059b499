"""Running a model step by step outside the engine, for the parity tests: requests on shuffled blocks and
sequence slots, caches full of garbage (an unwritten read shows), and one ragged forward's logits."""

from __future__ import annotations

from dataclasses import replace

import torch

from deepinfer_core.engine.request import Request
from deepinfer_core.engine.runner import ModelRunner
from deepinfer_core.sampling.params import SamplingParams

__all__ = ["garbage_runner", "shuffled_requests", "step_logits"]


def shuffled_requests(
    prompts, seed: int, *, num_blocks: int, seq_slots: int, block: int, spare_tokens: int = 0
) -> list[Request]:
    """Requests on shuffled blocks and sequence slots (not 0..n-1, not in order), with room for each prompt
    and `spare_tokens` more."""
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=g).tolist()
    slots = torch.randperm(seq_slots, generator=g).tolist()
    requests = []
    for i, prompt in enumerate(prompts):
        request = Request(str(i), None, list(prompt), SamplingParams(), seed=0, arrival=i)
        request.block_ids = [free.pop() for _ in range(-(-(len(prompt) + spare_tokens) // block))]
        request.seq_slot = slots.pop()
        requests.append(request)
    return requests


def garbage_runner(model, backend, *, num_blocks: int, seq_slots: int) -> ModelRunner:
    runner = ModelRunner(model, backend, num_blocks, num_seq_slots=seq_slots)
    g = torch.Generator().manual_seed(99)
    for cache in (c for layer in runner.caches for c in layer.values()):  # garbage: an unwritten read shows
        cache.copy_(50 * torch.randn(cache.shape, generator=g))
    return runner


@torch.inference_mode()
def step_logits(model, runner, scheduled, *, every_row: bool = True) -> list[torch.Tensor]:
    """One ragged forward of `scheduled` [(request, tokens)]; per request, logits [tokens, V]. Every row's
    logits are asked for, unless `every_row` is False: then the runner's needed_from stands, and a model may
    skip what the requests' last tokens do not need (the rows before them may be garbage)."""
    batch = runner.prepare(scheduled)
    meta = replace(batch.meta, needed_from=None) if every_row else batch.meta
    logits = model.logits(model.forward(batch.token_ids, batch.positions, meta, runner.caches))
    starts = batch.meta.query_start_loc.tolist()
    for request, count in scheduled:
        request.num_computed_tokens += count
    return [logits[starts[i] : starts[i + 1]] for i in range(len(scheduled))]
