"""Structured outputs at sampling: each constrained row's grammar mask onto a step's logits."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from deepinfer_core.engine.transfer import host_staging, to_device
from deepinfer_core.sampling.bitmask import masked_logits
from deepinfer_core.structured.grammars import GrammarState, fill_masks, mask_filler
from deepinfer_core.structured.stats import StructuredOutputStats

__all__ = ["GrammarMasks", "grammar_masks"]


class GrammarMasks:
    """A step's grammar masks, filled on the host: rows `rows` of its logits by `grammars` (drafts[k]: a verify
    step's drafted tokens before row rows[k]; its mask is the grammar's after them). `stats` gets each row's share
    of the fill time (in the background: until the worker has the interpreter lock back after the fill, an upper
    bound; it is not on the step's path).

    Without drafts the masks fill in the background (`in_background`): one call into llguidance on a worker
    thread, which holds no interpreter lock while it fills, so the engine does its other host work of the step
    meanwhile; the grammars must not be used elsewhere until `apply`. With drafts they are filled before this
    returns."""

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
        self._stats, self._seconds, self._filled = stats, 0.0, None
        if drafts is None:  # every row is written whole
            started = threading.Event()
            self._filled = _filler().submit(self._fill, mask_filler(grammars, self._host), started)
            # wait until the worker runs: it then needs the interpreter lock only once the masks are filled (without
            # this it could wait for the engine's thread to give up the lock: up to sys.getswitchinterval())
            started.wait()
        else:
            start = time.perf_counter()
            self._host.fill_(-1)  # a row whose drafts its grammar refuses stays unmasked (GrammarState.fill)
            fill_masks(grammars, self._host, drafts)
            self._seconds = time.perf_counter() - start

    @property
    def in_background(self) -> bool:
        """Whether the masks are being filled on the worker thread (until `apply`)."""
        return self._filled is not None

    def _fill(self, fill: Callable[[], None], started: threading.Event) -> None:
        start = time.perf_counter()
        started.set()
        fill()
        self._seconds = time.perf_counter() - start

    def apply(self, sampler, logits: torch.Tensor) -> torch.Tensor:
        """logits [S, V] with the rows masked (tokens a grammar does not allow next are -inf), through the
        sampler's apply_token_bitmask (a backend's kernel) where it has one. The mask reaches the device without
        the host waiting for the device's queued work (pinned memory and an asynchronous copy where the device has
        them)."""
        if self._filled is not None:
            self._filled.result()
        if self._stats is not None:
            self._stats.mask_seconds.extend([self._seconds / len(self.rows)] * len(self.rows))
        bitmask = self._host.to(logits.device, non_blocking=True)
        if len(self.rows) == logits.shape[0]:  # every row constrained: no gather and scatter of the rows
            return masked_logits(sampler, logits.clone(), bitmask)
        index = to_device(self.rows, logits.device)
        return logits.index_put((index,), masked_logits(sampler, logits[index], bitmask))


@functools.cache
def _filler() -> ThreadPoolExecutor:
    """The thread that fills masks in the background (one: a step's masks are one call into llguidance)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-grammar-masks")


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
