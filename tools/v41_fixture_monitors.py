"""Watch the DeepSeek-V4.1 reference for decisions that a tiny float difference could flip.

A fixture recorded on such a knife edge cannot be matched by another implementation with its own rounding, so
tools/v41_reference_fixtures.py reports both kinds in reference.json and its cases use seeds where there are none:
- exact ties at a top-k selection boundary (indexer, candidate blocks, MoE router);
- fake-quantised values (FP8 window KV, FP4 index keys/queries and compressed KV) that lie within EDGE_STEP of a
  rounding threshold or a scale step, EDGE_STEP being measured against the largest magnitude in the vector (float
  noise is relative to the largest terms, not to each small element).

Both monitors only observe: the wrapped calls return exactly what the reference's own calls return.
"""

from __future__ import annotations

import sys

import torch

EDGE_STEP = 1e-6  # times the vector's largest magnitude; float32 path-to-path noise here is a few 1e-7


class TopkTieMonitor:
    """Wraps torch.Tensor.topk while active; counts rows where the k-th and (k+1)-th scores are equal and finite
    (the chosen set then depends on torch.topk's tie rule) and keeps the smallest gap between them."""

    def __init__(self, modeling):
        self.modeling = modeling
        self.sites: dict[str, dict] = {}

    def _site(self, frame) -> str | None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, self.modeling.DeepseekV41Indexer):
            return f"indexer.layer{owner.layer_idx}"
        if isinstance(owner, self.modeling.DeepseekV41TopKRouter):
            return "router"
        if frame.f_code.co_name == "select_candidate_blocks":
            return "candidate_blocks"
        return None

    def _observe(self, site: str, scores: torch.Tensor, k: int, dim: int):
        stats = self.sites.setdefault(site, {"rows": 0, "selective_rows": 0, "tie_rows": 0, "min_boundary_gap": None})
        ordered = scores.detach().float().movedim(dim, -1).reshape(-1, scores.shape[dim])
        ordered = ordered.sort(dim=-1, descending=True).values
        stats["rows"] += ordered.shape[0]
        if k >= ordered.shape[-1]:
            return
        kth, next_ = ordered[:, k - 1], ordered[:, k]
        contested = (next_ > float("-inf")) & torch.isfinite(kth)  # the row drops a reachable entry
        stats["selective_rows"] += int(contested.sum())
        stats["tie_rows"] += int((contested & (kth == next_)).sum())
        if contested.any():
            gap = float((kth - next_)[contested].min())
            previous = stats["min_boundary_gap"]
            stats["min_boundary_gap"] = gap if previous is None else min(previous, gap)

    def __enter__(self):
        original, monitor = torch.Tensor.topk, self

        def topk(tensor, k, dim=-1, largest=True, sorted=True):
            site = monitor._site(sys._getframe(1))
            if site is not None and largest:
                monitor._observe(site, tensor, k, dim)
            return original(tensor, k, dim=dim, largest=largest, sorted=sorted)

        self._original = original
        torch.Tensor.topk = topk
        return self

    def __exit__(self, *exc):
        torch.Tensor.topk = self._original

    def report(self) -> dict:
        return {"any_exact_tie": any(s["tie_rows"] for s in self.sites.values()), "sites": self.sites}


class QuantEdgeMonitor:
    """Wraps the reference's fake-quant helpers while active. Each call is repeated with every input element moved
    up, then down, by EDGE_STEP times the largest magnitude of its vector; an output element that changes sat that
    close to a rounding threshold or its block to a scale step: a knife edge that float noise could flip."""

    _HELPERS = ("_fake_quant_fp8_block", "_fake_quant_fp4_block")

    def __init__(self, modeling):
        self.modeling = modeling
        self.sites: dict[str, dict] = {}

    def _wrap(self, name: str, original):
        monitor = self

        def fake_quant(x, *args, **kwargs):
            out = original(x, *args, **kwargs)
            owner = sys._getframe(1).f_locals.get("self")
            site = f"{name.removeprefix('_fake_quant_')}.{type(owner).__name__.removeprefix('DeepseekV41')}"
            stats = monitor.sites.setdefault(site, {"values": 0, "near_edge": 0})
            stats["values"] += out.numel()
            step = EDGE_STEP * x.detach().float().abs().amax(-1, keepdim=True)
            flipped = torch.zeros_like(out, dtype=torch.bool)
            for sign in (1.0, -1.0):
                flipped |= original((x.float() + sign * step).to(x.dtype), *args, **kwargs) != out
            stats["near_edge"] += int(flipped.sum())
            return out

        return fake_quant

    def __enter__(self):
        self._originals = {name: getattr(self.modeling, name) for name in self._HELPERS}
        for name, original in self._originals.items():
            setattr(self.modeling, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(self.modeling, name, original)

    def report(self) -> dict:
        near = any(s["near_edge"] for s in self.sites.values())
        return {"step_times_vector_amax": EDGE_STEP, "any_near_edge": near, "sites": self.sites}
