"""Structured outputs at sampling: each constrained row's grammar mask onto a step's logits."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from deepinfer_core.engine.transfer import host_staging, to_device
from deepinfer_core.sampling.bitmask import masked_logits
from deepinfer_core.structured.grammars import GrammarState, fill_masks
from deepinfer_core.structured.stats import StructuredOutputStats

__all__ = ["GrammarMasks", "grammar_masks"]


class GrammarMasks:
    """A step's grammar masks, filled on the host: rows `rows` of its logits by `grammars` (drafts[k]: a verify
    step's drafted tokens before row rows[k]; its mask is the grammar's after them). `stats` gets each row's share
    of the fill time (without drafts, one call into llguidance fills them all: `fill_masks`)."""

    def __init__(
        self,
        rows: Sequence[int],
        grammars: Sequence[GrammarState],
        device: torch.device,
        stats: StructuredOutputStats | None = None,
        drafts: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self.rows = list(rows)
        self._host = host_staging((len(rows), grammars[0].width), torch.int32, device)
        start = time.perf_counter()
        if drafts is not None:  # a row whose drafts its grammar refuses stays unmasked (GrammarState.fill)
            self._host.fill_(-1)
        fill_masks(grammars, self._host, drafts)  # without drafts every row is written whole
        if stats is not None:
            stats.mask_seconds.extend([(time.perf_counter() - start) / len(self.rows)] * len(self.rows))

    def apply(self, sampler, logits: torch.Tensor) -> torch.Tensor:
        """logits [S, V] with the rows masked (tokens a grammar does not allow next are -inf), through the
        sampler's apply_token_bitmask (a backend's kernel) where it has one. The mask reaches the device without
        the host waiting for the device's queued work (pinned memory and an asynchronous copy where the device has
        them)."""
        bitmask = self._host.to(logits.device, non_blocking=True)
        if len(self.rows) == logits.shape[0]:  # every row constrained: no gather and scatter of the rows
            return masked_logits(sampler, logits.clone(), bitmask)
        index = to_device(self.rows, logits.device)
        return logits.index_put((index,), masked_logits(sampler, logits[index], bitmask))


def grammar_masks(
    sampled: Sequence, draft_offsets: Sequence[int], device: torch.device, stats: StructuredOutputStats | None
) -> GrammarMasks | None:
    """The masks of a step's structured-output rows (`GrammarMasks`; a verify row's by the grammar after the
    drafts before it, `draft_offsets`), or None when no row is constrained. A grammar that refused its last token
    (its request ending) constrains nothing more."""
    constrained = [i for i, r in enumerate(sampled) if r.grammar is not None and r.grammar.error is None]
    if not constrained:
        return None
    grammars = [sampled[i].grammar for i in constrained]
    drafts = [sampled[i].draft_token_ids[: draft_offsets[i]] for i in constrained] if draft_offsets else None
    return GrammarMasks(constrained, grammars, device, stats, drafts)
