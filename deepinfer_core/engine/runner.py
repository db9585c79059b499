"""Runs one scheduled step: builds the ragged batch and its cache metadata, runs the model, samples.

Everything here is device-agnostic: tensors go to `backend.torch_device`, compute goes through the
objects the backend's hooks returned at engine build.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer_core.backend.extensions import LogitsProcessor
from deepinfer_core.backend.ops import AttentionMetadata
from deepinfer_core.backend.resolve import ResolvedBackend
from deepinfer_core.engine.request import Request
from deepinfer_core.sampling.sampler import SampleOutput, SamplingBatch

__all__ = ["ModelRunner", "StepBatch"]


@dataclass(frozen=True, slots=True)
class StepBatch:
    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: list[int]  # index into the step's requests of those that get a new token
    last_token_index: torch.Tensor  # [S] index in [T] of each sampled request's last token


class ModelRunner:
    def __init__(
        self, model, backend: ResolvedBackend, num_blocks: int, logits_processors: Sequence[LogitsProcessor] = ()
    ) -> None:
        self.model, self.backend = model, backend
        self.device = backend.torch_device
        self.block_size = backend.kv_layout.block_size
        self.caches = [backend.kv_layout.allocate(model.cache_spec, num_blocks) for _ in range(model.num_layers)]
        self.logits_processors = list(logits_processors)

    def prepare(self, scheduled: Sequence[tuple[Request, int]]) -> StepBatch:
        token_ids, positions, slots, starts, seq_lens, tables, sample_rows, last = [], [], [], [0], [], [], [], []
        for row, (request, count) in enumerate(scheduled):
            begin, end = request.num_computed_tokens, request.num_computed_tokens + count
            token_ids += request.all_token_ids[begin:end]
            positions += range(begin, end)
            slots += [
                request.block_ids[p // self.block_size] * self.block_size + p % self.block_size
                for p in range(begin, end)
            ]
            starts.append(starts[-1] + count)
            seq_lens.append(end)
            tables.append(request.block_ids)
            if end == request.num_tokens:  # the step reaches its last known token: sample the next one
                sample_rows.append(row)
                last.append(starts[-1] - 1)
        width = max(len(t) for t in tables)
        block_tables = torch.full((len(tables), width), -1, dtype=torch.int64)
        for row, table in enumerate(tables):
            block_tables[row, : len(table)] = torch.tensor(table, dtype=torch.int64)

        def on_device(values) -> torch.Tensor:
            return torch.as_tensor(values, dtype=torch.int64).to(self.device)

        meta = AttentionMetadata(on_device(starts), on_device(seq_lens), block_tables.to(self.device), on_device(slots))
        return StepBatch(on_device(token_ids), on_device(positions), meta, sample_rows, on_device(last))

    def _processed_logits(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        if not self.logits_processors:
            return logits
        rows = []
        for row, request in zip(logits, requests):
            for processor in self.logits_processors:
                row = processor(request.prompt_token_ids, request.output_token_ids, row)
            rows.append(row)
        return torch.stack(rows)

    @torch.inference_mode()
    def execute(self, scheduled: Sequence[tuple[Request, int]]) -> tuple[list[Request], SampleOutput | None]:
        """Run the step; returns the requests that got a token and the sampler's output for them."""
        batch = self.prepare(scheduled)
        hidden = self.model.forward(batch.token_ids, batch.positions, batch.meta, self.caches)  # [T, D]
        sampled = [scheduled[row][0] for row in batch.sample_rows]
        if not sampled:
            return [], None
        logits = self._processed_logits(self.model.logits(hidden[batch.last_token_index]), sampled)  # [S, V]
        sampling = SamplingBatch.build(
            [r.params for r in sampled],
            [r.seed for r in sampled],
            [r.prompt_token_ids for r in sampled],
            [r.output_token_ids for r in sampled],
            self.device,
        )
        return sampled, self.backend.sampler.sample(logits, sampling)
