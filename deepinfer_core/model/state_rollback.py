"""Rolling rejected draft tokens back out of per-sequence state caches whose row for position p is p % rows.

DeepSeek-V4's compressor and indexer states (SEQUENCE_STATE caches) hold the projections of a sequence's last
`rows` tokens, the token at position p in row p % rows. A verify step writes rows for its drafted positions
too; where drafts are rejected, those rows overwrote the projections of tokens `rows` positions earlier,
which the sequence's next compressed entries may still need. `save` copies the state rows of the verifying
sequences before the step; `restore` puts back the rows of the rejected positions. (The window rings need
nothing: their `rollback_slots` spare ring slots keep a rejected write off every entry a later query reads,
for up to that many drafts. Paged caches need nothing: a rejected position's entry lies past the sequence's
length and is rewritten before it is read.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer_core.kv.layout import CacheKind, CacheSpec, KVLayout

__all__ = ["PositionRowStates"]


class PositionRowStates:
    def __init__(self, layout: KVLayout, cache_specs: Sequence[dict[str, CacheSpec]], device: torch.device) -> None:
        self.layout, self.device = layout, device
        self.states = [
            {name: spec for name, spec in layer.items() if spec.kind is CacheKind.SEQUENCE_STATE}
            for layer in cache_specs
        ]
        rings = [spec.rollback_slots for layer in cache_specs for spec in layer.values()
                 if spec.kind is CacheKind.SLIDING_WINDOW]  # fmt: skip
        spans = [spec.state_shape[0] for layer in self.states for spec in layer.values()]
        # drafts a verify step may hold: within the rings' spare slots, and fewer than any state's rows (so a
        # step's accepted and rejected positions never share a row)
        self.max_drafts = min([*rings, *(s - 1 for s in spans)], default=1 << 30)

    def save(self, caches: Sequence[dict[str, torch.Tensor]], seq_slots: Sequence[int]) -> list[dict]:
        """Copies of the state rows of the sequences in `seq_slots`, per layer and cache."""
        slots = torch.tensor(list(seq_slots), dtype=torch.int64, device=self.device)
        return [
            {name: self.layout.gather(cache[name], spec, slots) for name, spec in layer.items()}
            for layer, cache in zip(self.states, caches)
        ]

    def restore(
        self,
        caches: Sequence[dict[str, torch.Tensor]],
        seq_slots: Sequence[int],
        saved: list[dict],
        rejected: Sequence[range],
    ) -> None:
        """Put back, for sequence i of `seq_slots` (as saved), the rows of its `rejected[i]` positions."""
        keep = [i for i, positions in enumerate(rejected) if len(positions)]
        if not keep:
            return
        slots = torch.tensor([seq_slots[i] for i in keep], dtype=torch.int64, device=self.device)
        for layer, cache, before in zip(self.states, caches, saved):
            for name, spec in layer.items():
                rows = spec.state_shape[0]
                now = self.layout.gather(cache[name], spec, slots)
                for j, i in enumerate(keep):
                    lost = torch.tensor([p % rows for p in rejected[i]], dtype=torch.int64, device=self.device)
                    now[j, lost] = before[name][i, lost]
                self.layout.write(cache[name], spec, slots, now)
