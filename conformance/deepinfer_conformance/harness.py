"""What cases use: the backend under test and the reference, resolved once per dtype, comparisons that
record their errors for the report, and skips that carry the backend's own reason.

A case skips because of what the backend declares through `Suite.require*` (a `CapabilitySkip`, which
names the capability); any other `pytest.skip` counts as an environment skip (this machine, this torch
build, the reference's own limits). The report's coverage is built from that distinction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from deepinfer_core.backend.registry import BackendEntry
from deepinfer_core.backend.resolve import ResolvedBackend, resolve_backend

__all__ = ["CapabilitySkip", "Check", "Suite", "tolerance"]

# torch.testing.assert_close defaults (rtol, atol); atol grows with sqrt(reduction length) for ops that sum
_TOLERANCES = {torch.float32: (1.3e-6, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float16: (1e-3, 1e-5)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tolerance(dtype: torch.dtype, reduce_dim: int = 1) -> tuple[float, float]:
    rtol, atol = _TOLERANCES[dtype]
    return rtol, atol * math.sqrt(max(1, reduce_dim))


class CapabilitySkip(pytest.skip.Exception):
    """A skip because the backend under test declares it cannot do something.

    capability: what, as `Capabilities.<field>` or `<field>:<value>`, e.g. "unsupported:expert_ffn",
    "dtypes:bfloat16", "cache_kinds:sliding_window", "batch_invariant". The report groups skips by it.
    """

    __module__ = "builtins"  # pytest -rs shows "CapabilitySkip: <reason>", as it shows "Skipped: <reason>"

    def __init__(self, capability: str, reason: str) -> None:
        super().__init__(reason)
        self.capability = capability


@dataclass
class Suite:
    """The session's backends. `under_test` is the backend named by --deepinfer-backend."""

    under_test: BackendEntry
    reference: BackendEntry
    _resolved: dict = field(default_factory=dict)

    def resolved(
        self, entry: BackendEntry, dtype: torch.dtype, block_size: int | None = None, batch_invariant: bool = False
    ) -> ResolvedBackend:
        key = (entry.name, dtype, block_size, batch_invariant)
        if key not in self._resolved:
            self._resolved[key] = resolve_backend(
                entry, dtype=dtype, block_size=block_size, batch_invariant=batch_invariant
            )
        return self._resolved[key]

    def pair(self, dtype: torch.dtype, block_size: int | None = None) -> tuple[ResolvedBackend, ResolvedBackend]:
        """(backend under test, reference) for `dtype`; skips when the backend does not compute in it."""
        self.require_dtype(dtype)
        return self.resolved(self.under_test, dtype, block_size), self.resolved(self.reference, dtype, block_size)

    @property
    def capabilities(self):
        return self.under_test.capabilities

    def require(self, op: str) -> None:
        """Skip unless the backend supports `op` (an op-table method or feature name)."""
        supported = self.capabilities.supports(op)
        if supported is not True:
            raise CapabilitySkip(f"unsupported:{op}", f"{self.under_test.name} does not support {op}: {supported}")

    def require_dtype(self, dtype: torch.dtype) -> None:
        """Skip unless both the backend and the reference compute in `dtype`."""
        name = str(dtype).removeprefix("torch.")
        if name not in self.capabilities.dtypes:
            declared = ", ".join(self.capabilities.dtypes)
            raise CapabilitySkip(
                f"dtypes:{name}", f"{self.under_test.name} does not compute in {name} (it declares {declared})"
            )
        if name not in self.reference.capabilities.dtypes:  # not the backend's doing: an environment skip
            pytest.skip(f"the reference backend {self.reference.name} does not compute in {name}, so nothing checks it")

    def require_declared(self, field: str, value=None, why: str = "") -> None:
        """Skip unless the backend declares `value` in the tuple `Capabilities.<field>` (cache_kinds,
        communicators, weight_formats, kv_dtypes) or, with no value, claims the flag `Capabilities.<field>`
        (batch_invariant, deterministic_sampling). `why` says what the case needs it for."""
        caps, name = self.capabilities, self.under_test.name
        declared = getattr(caps, field)
        if field == "kv_dtypes":
            declared = declared or caps.dtypes  # empty means "the compute dtypes"
        if value is None:
            if declared:
                return
            capability, reason = field, f"{name} does not claim {field} (Capabilities.{field} is False)"
        else:
            if value in declared:
                return
            shown = getattr(value, "value", value)  # a CacheKind by its name
            listed = ", ".join(str(getattr(v, "value", v)) for v in declared) or "none"
            capability = f"{field}:{shown}"
            reason = f"{name} does not declare {shown!r} in Capabilities.{field} (it lists {listed})"
        raise CapabilitySkip(capability, f"{reason}; {why}" if why else reason)


class Check:
    """Comparisons that assert and record max abs / rel error and the tolerance on the test item."""

    def __init__(self, item: pytest.Item) -> None:
        self.item = item
        self.max_abs = 0.0
        self.max_rel = 0.0
        self.tolerance: dict | None = None

    def _record(self, **fields) -> None:
        self.item.user_properties[:] = [p for p in self.item.user_properties if p[0] != "deepinfer"]
        self.item.user_properties.append(("deepinfer", fields))

    def close(
        self,
        actual: torch.Tensor,
        expected: torch.Tensor,
        dtype: torch.dtype,
        reduce_dim: int = 1,
        what: str = "output",
        magnitude: float = 0.0,
    ) -> None:
        """Assert actual ≈ expected within the dtype's tolerance (scaled for a reduction of reduce_dim).

        magnitude: the largest |input| an output is a weighted average of (e.g. attention values); a
        kernel may round its weights to `dtype`, so the absolute tolerance is at least one ulp of it.
        """
        rtol, atol = tolerance(dtype, reduce_dim)
        atol = max(atol, torch.finfo(dtype).eps * magnitude)
        self._measure(actual, expected)
        self.tolerance = {"rtol": rtol, "atol": atol}
        self._record(max_abs_err=self.max_abs, max_rel_err=self.max_rel, tolerance=self.tolerance)
        torch.testing.assert_close(
            actual.cpu().float(), expected.cpu().float(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}"
        )

    def equal(self, actual: torch.Tensor, expected: torch.Tensor, what: str = "output") -> None:
        """Assert bitwise equality (batch invariance, integer outputs, canonical cache contents)."""
        self._measure(actual, expected)
        self.tolerance = {"exact": True}
        self._record(max_abs_err=self.max_abs, max_rel_err=self.max_rel, tolerance=self.tolerance)
        a, e = actual.cpu(), expected.cpu()
        assert a.shape == e.shape and a.dtype == e.dtype, f"{what}: {a.shape}/{a.dtype} vs {e.shape}/{e.dtype}"
        if not torch.equal(a, e):
            mismatched = int((a != e).sum())
            raise AssertionError(
                f"{what}: {mismatched} of {a.numel()} elements differ (max abs {self.max_abs:.3g}); "
                f"expected bitwise equality"
            )

    def metric(self, **fields) -> None:
        """Record other measurements (agreement rates, statistics) for the report."""
        self._record(**fields)

    def _measure(self, actual: torch.Tensor, expected: torch.Tensor) -> None:
        if actual.shape != expected.shape or actual.numel() == 0:
            return
        a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
        finite = torch.isfinite(a) & torch.isfinite(e)
        diff = (a - e).abs().where(finite, torch.zeros_like(a))
        self.max_abs = max(self.max_abs, float(diff.max()))
        self.max_rel = max(
            self.max_rel, float((diff / e.abs().clamp_min(1e-12)).where(finite, torch.zeros_like(a)).max())
        )
