"""Structured outputs at sampling: each constrained row's grammar mask onto a step's logits."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from deepinfer_core.engine.transfer import host_staging, to_device
from deepinfer_core.sampling.bitmask import masked_logits
from deepinfer_core.structured.grammars import GrammarState
from deepinfer_core.structured.stats import StructuredOutputStats

__all__ = ["apply_grammars", "mask_grammar_rows"]


def apply_grammars(
    sampler,
    logits: torch.Tensor,
    rows: Sequence[int],
    grammars: Sequence[GrammarState],
    stats: StructuredOutputStats | None = None,
    drafts: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """logits [S, V] with row rows[k] masked by grammars[k] (tokens it does not allow next are -inf), through the
    sampler's apply_token_bitmask (a backend's kernel) where it has one. drafts[k]: a verify step's drafted tokens
    before row rows[k] (its mask is the grammar's after them). The masks are filled on the host (`GrammarState.fill`);
    `stats` gets each row's fill time. The mask reaches the device without the host waiting for the device's
    queued work (the step's model, issued before this): pinned memory and an asynchronous copy where the device
    has them."""
    mask = host_staging((len(rows), grammars[0].width), torch.int32, logits.device).fill_(-1)
    for k, grammar in enumerate(grammars):
        start = time.perf_counter()
        grammar.fill(mask, k, drafts[k] if drafts is not None else ())
        if stats is not None:
            stats.mask_seconds.append(time.perf_counter() - start)
    bitmask = mask.to(logits.device, non_blocking=True)
    if len(rows) == logits.shape[0]:  # every row constrained: no gather and scatter of the rows
        return masked_logits(sampler, logits.clone(), bitmask)
    index = to_device(rows, logits.device)
    return logits.index_put((index,), masked_logits(sampler, logits[index], bitmask))


def mask_grammar_rows(
    sampler, logits: torch.Tensor, sampled: Sequence, draft_offsets: Sequence[int], stats: StructuredOutputStats | None
) -> tuple[torch.Tensor, list[int]]:
    """A step's logits with each structured-output row masked (`apply_grammars`; a verify row by the grammar after
    the drafts before it, `draft_offsets`), and those rows. A grammar that refused its last token (its request
    ending) constrains nothing more."""
    constrained = [i for i, r in enumerate(sampled) if r.grammar is not None and r.grammar.error is None]
    if not constrained:
        return logits, constrained
    grammars = [sampled[i].grammar for i in constrained]
    drafts = [sampled[i].draft_token_ids[: draft_offsets[i]] for i in constrained] if draft_offsets else None
    return apply_grammars(sampler, logits, constrained, grammars, stats, drafts), constrained
