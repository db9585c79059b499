"""Which of a step's tokens each DeepSeek-V4.1 layer processes ("CED prefill", as DeepSeek's engine calls it).

A token whose final hidden state nobody needs matters only through the caches it leaves. Past the last KV
source (the CED decoder layers) a layer's only cache is its window, which only the next window - 1 positions
read; so a long prompt needs those layers only for its last few windows, and the tokens before skip them.
The same holds for the tokens a prefix hit replays to rebuild the windows.

Per sequence, with F its first position whose final hidden state is needed (`AttentionMetadata.needed_from`)
and C its cached prefix (`cached_lens`: positions below are in the shared paged caches), from the top down:

    out = F                           # positions whose output of this layer is needed: out and after
    for each layer l, the last first:
        in_l = out - (window - 1)     # a query at p attends this layer's window entries p - window + 1 .. p
        if l is a KV source:
            in_l = min(in_l, C)       # every compressed entry and index key past the cached prefix is written
        out = in_l                    # the layer below must then be right from in_l on

Layer l processes the step's tokens at positions >= in_l (a suffix of the sequence's tokens in the step:
possibly none, possibly all); those below its `out` compute outputs nobody reads. Nothing else reaches back:
- A KV source writes the entries of the groups that start at C or later (C is a multiple of the block size,
  which every ratio divides), from tokens at C or later; its partial-group state is read back only for such
  groups. Every layer of the group reads those entries, and the index keys, from the cache, and its indexer
  scores them per query: the compressed KV needs no reach beyond the clamp to C, whatever the ratio.
- The top-k entries and candidate blocks an index source publishes are per query; a later layer needs those
  of its own tokens, a subset of the source's (in_l never falls as l grows).
- Engram layers, norms, hyper-connections and the MoE work per token; the n-gram hashes are taken once, for
  every token, before the first layer.
- A narrowed layer leaves the ring slots of the positions it skips as they were. Only its tokens below `out`
  would read them, so its step's window_starts rise to in_l and they read none (their outputs are unused:
  this only keeps stale entries out of every sum). In a later step F is no smaller and C the same, so in_l is
  no smaller: nothing needed reads below it there either. Each layer writes the ring entries of
  F - window + 1 .. the step's end at least (the last `window` positions when F is the last token); the
  rollback slots before them may keep older entries, which no query reads (a verify step's positions all
  need their outputs, so its layers skip none of them).
"""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer_core.model.config_v41 import DeepseekV41Config

__all__ = ["layer_starts"]


def layer_starts(cfg: DeepseekV41Config, needed_from: Sequence[int], cached_lens: Sequence[int]) -> list[list[int]]:
    """Per layer, per sequence: the first position the layer processes (in_l of the module docstring)."""
    reach = cfg.sliding_window - 1
    starts, needed = [], list(needed_from)
    for plan in reversed(cfg.layers):
        needed = [p - reach for p in needed]
        if plan.is_kv_source:
            needed = [min(p, cached) for p, cached in zip(needed, cached_lens)]
        starts.append(needed)
    return starts[::-1]
