"""What cases use: the backend under test and the reference, resolved once per dtype, comparisons that
record their errors for the report, and skips that carry the backend's own reason."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from deepinfer_core.backend.registry import BackendEntry
from deepinfer_core.backend.resolve import ResolvedBackend, resolve_backend

__all__ = ["Check", "Suite", "tolerance"]

# torch.testing.assert_close defaults (rtol, atol); atol grows with sqrt(reduction length) for ops that sum
_TOLERANCES = {torch.float32: (1.3e-6, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float16: (1e-3, 1e-5)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tolerance(dtype: torch.dtype, reduce_dim: int = 1) -> tuple[float, float]:
    rtol, atol = _TOLERANCES[dtype]
    return rtol, atol * math.sqrt(max(1, reduce_dim))


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
        supported = self.capabilities.supports(op)
        if supported is not True:
            pytest.skip(f"{self.under_test.name} does not support {op}: {supported}")

    def require_dtype(self, dtype: torch.dtype) -> None:
        name = str(dtype).removeprefix("torch.")
        if name not in self.capabilities.dtypes or name not in self.reference.capabilities.dtypes:
            pytest.skip(
                f"{self.under_test.name} does not compute in {name} (it declares {', '.join(self.capabilities.dtypes)})"
            )


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
