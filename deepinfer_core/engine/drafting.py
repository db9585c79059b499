"""A draft model's part of a step (engine/runner.py runs it): the inputs it reads besides the target's states, and
how many drafts each request accepted, counted on the device."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer_core.engine.pending import InFlightTokens, filled
from deepinfer_core.engine.request import Request
from deepinfer_core.engine.step_batch import DraftingInputs
from deepinfer_core.engine.transfer import to_device

__all__ = ["accepted_drafts", "drafting_inputs"]


def drafting_inputs(
    scheduled: Sequence[tuple[Request, int]],
    sample_rows: list[int],
    offsets: list[int],
    uniform: int | None,
    ahead_rows: list[int],
    in_flight: InFlightTokens | None,
    values: torch.Tensor | None,
    *,
    block_size: int,
    max_position: int,
    device: torch.device,
) -> DraftingInputs:
    """What a draft model reads of a step besides the target's states, built on the host and sent to `device`.
    ahead_rows[i] >= 0: sequence i's drafts are in flight (`in_flight.values()`, given as `values`); block_size and
    max_position bound each request's last draft position (its blocks, the model's positions)."""
    next_ids, expected, first_row, seq_index, num_drafts, limits = [], [], [], [], [], []
    next_at, next_from, expected_at, expected_from = [], [], [], []  # filled from `values`, as in prepare
    for row, (request, count) in enumerate(scheduled):
        if ahead_rows[row] >= 0:  # the token after its last is its first draft, and so on
            next_at += range(len(next_ids), len(next_ids) + count - 1)
            next_from += [in_flight.source(request, j) for j in range(count - 1)]
            after = [0] * (count - 1)
        else:
            begin = request.num_computed_tokens
            seq = request.all_token_ids + request.draft_token_ids
            after = seq[begin + 1 : begin + count + 1]
        next_ids += after + [0] * ((uniform or count) - len(after))  # 0: sampled there, or padding
    for i, (row, offset) in enumerate(zip(sample_rows, offsets)):
        request = scheduled[row][0]
        drafts = request.draft_token_ids
        if offset < len(drafts) and ahead_rows[row] >= 0:
            expected_at.append(i)
            expected_from.append(in_flight.source(request, offset))
        expected.append(drafts[offset] if offset < len(drafts) else -1)
        if offset == 0:
            first_row.append(i)
            seq_index.append(row)
            num_drafts.append(len(drafts))
            limits.append(min(len(request.block_ids) * block_size - 1, max_position))
    return DraftingInputs(
        filled(to_device(next_ids, device), next_at, next_from, values),
        filled(to_device(expected, device), expected_at, expected_from, values),
        *(to_device(v, device) for v in (first_row, seq_index, num_drafts, limits)),
        max_drafts=max(num_drafts, default=0),
    )


def accepted_drafts(d: DraftingInputs, sampled: torch.Tensor) -> torch.Tensor:
    """[R] each sampled request's accepted drafts, on the device: its leading rows whose sampled token is the
    draft that row checks."""
    width = d.max_drafts
    if not width:
        return torch.zeros_like(d.first_row)
    steps = torch.arange(width, device=sampled.device)
    rows = (d.first_row[:, None] + steps).clamp(max=sampled.shape[0] - 1)  # [R, width]
    matches = (sampled[rows] == d.expected[rows]) & (steps < d.num_drafts[:, None])
    return matches.to(torch.int64).cumprod(dim=1).sum(dim=1)
