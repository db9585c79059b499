"""Ranks in step through the MoE layers: under expert parallelism every rank takes part in every MoE layer's
dispatch and combine (its experts serve the other ranks' rows), so every rank runs each MoE layer exactly once
per model forward, in layer order, whether it has tokens or not.

A rank with no step to run runs an idle forward (`idle_forward`: every MoE layer with no tokens of its own;
nothing else of the model, which involves no other rank). A forward that stops early (DeepSeek-V4.1's layer
skipping can leave the last layers with no tokens) is completed the same way (`complete`). The ranks agree on
whether anyone has work by one all-reduce a step (`any_rank_busy`), as vLLM's data-parallel coordinator does.
"""

from __future__ import annotations

from deepinfer_core.model.layers import moe_layers

__all__ = ["MoELockstep"]


class MoELockstep:
    """One rank's MoE layers, run once each per forward (see the module docstring)."""

    def __init__(self, model) -> None:
        self.layers = moe_layers(model)
        self.forwards = 0  # model forwards this rank ran, idle ones included

    def begin(self) -> None:
        """Before a model forward."""
        for layer in self.layers:
            layer.calls = 0

    def complete(self) -> None:
        """After a model forward: the MoE layers it did not reach run idle, in order. Only a suffix may be
        missing (a forward that runs layer l has run every layer before it), else the ranks' collectives would
        pair different layers; more than one call of a layer is refused for the same reason."""
        calls = [layer.calls for layer in self.layers]
        reached = next((i for i, n in enumerate(calls) if n == 0), len(calls))
        if any(calls[reached:]) or any(n > 1 for n in calls):
            raise RuntimeError(
                f"a forward ran the MoE layers {calls} times each: under expert parallelism every layer runs "
                f"once, in order, or the ranks' collectives no longer match"
            )
        for layer in self.layers[reached:]:
            layer.idle()
        self.forwards += 1

    def idle_forward(self) -> None:
        """A forward with no tokens: every MoE layer idle."""
        self.begin()
        self.complete()
