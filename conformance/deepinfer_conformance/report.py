"""The conformance report: versioned JSON (cases, errors, tolerances, backend and machine facts) and a table."""

from __future__ import annotations

import datetime
import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer_conformance import REPORT_FORMAT

__all__ = ["CaseResult", "build_report", "format_table", "write_report"]


@dataclass
class CaseResult:
    case: str
    status: str  # passed, failed, error, skipped
    reason: str  # skip reason or failure message
    measured: dict = field(default_factory=dict)  # max_abs_err, max_rel_err, tolerance, other metrics
    duration_s: float = 0.0

    def as_dict(self) -> dict:
        return {
            "case": self.case,
            "status": self.status,
            "reason": self.reason,
            **self.measured,
            "duration_s": round(self.duration_s, 4),
        }


def _machine() -> dict:
    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def build_report(backend, results: list[CaseResult], duration_s: float) -> dict:
    from deepinfer_core import __version__
    from deepinfer_core.backend.hookspecs import API_VERSION

    counts = {s: sum(r.status == s for r in results) for s in ("passed", "failed", "error", "skipped")}
    return {
        "format": REPORT_FORMAT,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "deepinfer_version": __version__,
        "contract_api_version": API_VERSION,
        "backend": {
            "name": backend.name,
            "distribution": backend.origin.distribution,
            "version": backend.origin.version,
            "probe": {
                "available": backend.probe.available,
                "reason": backend.probe.reason,
                **dict(backend.probe.facts),
            },
            "capabilities": backend.capabilities.as_dict(),
        },
        "reference": "cpu",
        "machine": _machine(),
        "summary": {
            **counts,
            "total": len(results),
            "duration_s": round(duration_s, 2),
            "conformant": counts["failed"] == 0 and counts["error"] == 0,
        },
        "cases": [r.as_dict() for r in results],
    }


def write_report(report: dict, path: str | os.PathLike) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(report, indent=2) + "\n")


def _number(value) -> str:
    return f"{value:.2e}" if isinstance(value, float) else ("" if value is None else str(value))


def _tolerance(measured: dict) -> str:
    tol = measured.get("tolerance")
    if not tol:
        return ""
    return "exact" if tol.get("exact") else f"rtol {tol['rtol']:.1e} atol {tol['atol']:.1e}"


def format_table(results: list[CaseResult]) -> str:
    rows = [("CASE", "STATUS", "MAX ABS", "MAX REL", "TOLERANCE", "REASON")]
    for r in results:
        reason = r.reason.splitlines()[0][:100] if r.reason else ""
        rows.append(
            (
                r.case,
                r.status,
                _number(r.measured.get("max_abs_err")),
                _number(r.measured.get("max_rel_err")),
                _tolerance(r.measured),
                reason,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:5], widths)) + "  " + row[5] for row in rows]
    counts = {s: sum(r.status == s for r in results) for s in ("passed", "failed", "error", "skipped")}
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(line.rstrip() for line in lines)
