"""The conformance report: a pydantic model (cases, errors, tolerances, coverage, backend and machine facts)
serialized to versioned JSON with a shipped JSON Schema, and the readable table printed after a run.

`python -m deepinfer_conformance.report --schema [PATH]` prints (or writes) the schema generated from the
model; `--validate FILE` checks a report against the model.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError

from deepinfer_conformance import REPORT_FORMAT, REPORT_SCHEMA

__all__ = [
    "CaseReport",
    "ConformanceReport",
    "Coverage",
    "build_report",
    "format_table",
    "json_schema",
    "verdict",
    "write_report",
]

Status = Literal["passed", "failed", "error", "skipped"]
SkipKind = Literal["capability", "environment"]
_MEASURED = ("max_abs_err", "max_rel_err", "tolerance")  # fields of CaseReport; other metrics go to `metrics`


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Tolerance(_Model):
    """Bitwise (`exact`) or torch.testing-style closeness: |actual - expected| <= atol + rtol * |expected|."""

    exact: bool = False
    rtol: float | None = None
    atol: float | None = None


class Skip(_Model):
    """Why a case did not run. `capability` kind: the backend declares it cannot do what the case tests
    (`capability` names it, as Capabilities.<field>[:<value>]); `environment`: anything else (this machine,
    this torch build, the reference backend's limits, the case's geometry)."""

    kind: SkipKind
    capability: str | None = None


class CaseReport(_Model):
    case: str = Field(description="module::test[parameters], e.g. ops::test_rms_norm[64-torch.float32]")
    status: Status
    reason: str = Field("", description="skip reason or failure message, whole")
    skip: Skip | None = None
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    tolerance: Tolerance | None = None
    metrics: dict[str, JsonValue] = Field(default_factory=dict, description="other measurements of the case")
    duration_s: float = 0.0


class NotExercised(_Model):
    """Cases skipped for one capability (or, for environment skips, one reason)."""

    kind: SkipKind
    capability: str | None = None
    reason: str = Field(description="the first such case's skip reason")
    cases: int


class Coverage(_Model):
    """How much of the suite the verdict rests on. `applicable` = `total` - `skipped_capability`."""

    total: int = Field(description="cases selected for this run (the suite, less `deselected`)")
    run: int = Field(description="passed + failed + error")
    applicable: int = Field(description="cases whose capabilities the backend declares")
    skipped_capability: int
    skipped_environment: int
    run_fraction: float = Field(description="run / total")
    applicable_run_fraction: float = Field(description="run / applicable")
    deselected: int = Field(0, description="cases of the suite left out by the selection")
    selection: str = Field("", description="the -k / -m expression that selected the cases; empty: the whole suite")
    not_exercised: list[NotExercised] = Field(default_factory=list)


class Summary(_Model):
    passed: int
    failed: int
    error: int
    skipped: int
    total: int
    duration_s: float
    conformant: bool = Field(description="no failure or error among the cases run; read it with `coverage`")


class Probe(_Model):
    available: bool
    reason: str
    facts: dict[str, str] = Field(default_factory=dict)


class CapabilitiesReport(BaseModel):
    """Capabilities.as_dict(); fields added to the contract later pass through."""

    model_config = ConfigDict(extra="allow")

    dtypes: list[str]
    cache_kinds: list[str]
    block_sizes: list[int]
    kv_dtypes: list[str]
    kv_formats: list[str] = Field(default_factory=list)  # added in a later report; older ones lack it
    batch_invariant: bool
    deterministic_sampling: bool
    graph_capture: bool
    async_scheduling: bool
    communicators: list[str]
    weight_formats: list[str]
    unsupported: dict[str, str]


class BackendReport(_Model):
    name: str
    distribution: str
    version: str
    probe: Probe
    capabilities: CapabilitiesReport


class Machine(_Model):
    host: str
    platform: str
    processor: str
    cpus: int | None
    python: str
    torch: str


class ConformanceReport(_Model):
    """What `deepinfer conformance --report FILE` writes."""

    format: Literal["deepinfer-conformance/2"]
    created: datetime.datetime
    deepinfer_version: str
    contract_api_version: int
    backend: BackendReport
    reference: str = Field(description="the backend every case compares with")
    machine: Machine
    summary: Summary
    coverage: Coverage
    cases: list[CaseReport]


def json_schema() -> dict:
    """The JSON Schema of a report, as shipped in report.schema.json."""
    schema = ConformanceReport.model_json_schema(mode="serialization")
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


def case_report(
    case: str, status: Status, reason: str, measured: dict, duration_s: float, skip: Skip | None = None
) -> CaseReport:
    """One case's entry; `measured` is what Check recorded (known fields, then any other metrics)."""
    known = {key: measured[key] for key in _MEASURED if key in measured}
    metrics = {key: value for key, value in measured.items() if key not in _MEASURED}
    metrics = json.loads(json.dumps(metrics, default=str))  # tuples become lists; anything else its str()
    return CaseReport(
        case=case, status=status, reason=reason, skip=skip, duration_s=round(duration_s, 4), metrics=metrics, **known
    )


def _coverage(cases: list[CaseReport], deselected: int, selection: str) -> Coverage:
    skipped = [c for c in cases if c.status == "skipped"]
    by_capability = sum(c.skip is not None and c.skip.kind == "capability" for c in skipped)
    run, total = len(cases) - len(skipped), len(cases)
    groups: dict[tuple, NotExercised] = {}
    for c in skipped:
        skip = c.skip or Skip(kind="environment")
        key = (skip.kind, skip.capability or c.reason)
        if key in groups:
            groups[key].cases += 1
        else:
            groups[key] = NotExercised(kind=skip.kind, capability=skip.capability, reason=c.reason, cases=1)
    return Coverage(
        total=total,
        run=run,
        applicable=total - by_capability,
        skipped_capability=by_capability,
        skipped_environment=len(skipped) - by_capability,
        run_fraction=round(run / total, 4) if total else 0.0,
        applicable_run_fraction=round(run / (total - by_capability), 4) if total > by_capability else 0.0,
        deselected=deselected,
        selection=selection,
        not_exercised=sorted(groups.values(), key=lambda g: (g.kind != "capability", -g.cases)),
    )


def _machine() -> Machine:
    import torch

    return Machine(
        host=platform.node(),
        platform=platform.platform(),
        processor=platform.processor() or platform.machine(),
        cpus=os.cpu_count(),
        python=platform.python_version(),
        torch=torch.__version__,
    )


def build_report(
    backend, cases: list[CaseReport], duration_s: float, deselected: int = 0, selection: str = "", reference="cpu"
) -> ConformanceReport:
    """The report of one run of the suite against `backend` (a BackendEntry)."""
    from deepinfer_core import __version__
    from deepinfer_core.backend.hookspecs import API_VERSION

    counts = Counter(c.status for c in cases)
    return ConformanceReport(
        format=REPORT_FORMAT,
        created=datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0),
        deepinfer_version=__version__,
        contract_api_version=API_VERSION,
        backend=BackendReport(
            name=backend.name,
            distribution=backend.origin.distribution,
            version=backend.origin.version,
            probe=Probe(
                available=backend.probe.available, reason=backend.probe.reason, facts=dict(backend.probe.facts)
            ),
            capabilities=CapabilitiesReport(**backend.capabilities.as_dict()),
        ),
        reference=reference,
        machine=_machine(),
        summary=Summary(
            passed=counts["passed"],
            failed=counts["failed"],
            error=counts["error"],
            skipped=counts["skipped"],
            total=len(cases),
            duration_s=round(duration_s, 2),
            conformant=counts["failed"] == 0 and counts["error"] == 0,
        ),
        coverage=_coverage(cases, deselected, selection),
        cases=cases,
    )


def write_report(report: ConformanceReport, path: str | os.PathLike) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(report.model_dump_json(indent=2, exclude_none=True) + "\n")


# ---------------------------------------------------------------------------------------------
# The table and the verdict
# ---------------------------------------------------------------------------------------------


def _number(value) -> str:
    return f"{value:.2e}" if isinstance(value, float) else ("" if value is None else str(value))


def _tolerance(tol: Tolerance | None) -> str:
    if tol is None:
        return ""
    return "exact" if tol.exact else f"rtol {tol.rtol:.1e} atol {tol.atol:.1e}"


def _wrapped(text: str, indent: str, width: int, hang: str = "  ") -> list[str]:
    """Every line of `text`, whole, wrapped at `width` under `indent` (never cut)."""
    lines = []
    for line in text.splitlines() or [""]:
        lines += textwrap.wrap(
            line,
            width,
            initial_indent=indent,
            subsequent_indent=indent + hang,
            break_long_words=False,
            break_on_hyphens=False,
        ) or [""]
    return lines


def _percent(fraction: float) -> str:
    return f"{fraction:.0%}"


def _label(group: NotExercised) -> str:
    return group.capability or f"environment: {group.reason}"


def format_table(report: ConformanceReport, width: int | None = None) -> str:
    """One row per case; failure messages whole under their row; skip reasons once each, as [n] notes."""
    width = width or max(80, shutil.get_terminal_size((120, 24)).columns)
    groups = report.coverage.not_exercised
    note = {(g.kind, g.capability or g.reason): i for i, g in enumerate(groups, 1)}
    rows, messages = [("CASE", "STATUS", "MAX ABS", "MAX REL", "TOLERANCE", "REASON")], [""]
    for c in report.cases:
        skip = c.skip or Skip(kind="environment")
        reason = f"[{note[(skip.kind, skip.capability or c.reason)]}]" if c.status == "skipped" else ""
        cells = (c.case, c.status, _number(c.max_abs_err), _number(c.max_rel_err), _tolerance(c.tolerance), reason)
        rows.append(cells)
        messages.append(c.reason if c.status in ("failed", "error") else "")
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row, message in zip(rows, messages):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if message:
            lines += _wrapped(message, "    ", width)
    s = report.summary
    lines.append(f"{s.passed} passed, {s.failed} failed, {s.error} error, {s.skipped} skipped")
    return "\n".join(lines + [""] + coverage_lines(report, width))


def coverage_lines(report: ConformanceReport, width: int = 100) -> list[str]:
    """What the verdict covers: cases run of all and of the applicable ones, and each thing not exercised."""
    cov = report.coverage
    applicable = (
        f"{cov.run} of {cov.applicable} applicable ({_percent(cov.applicable_run_fraction)})"
        if cov.applicable
        else "no case applicable"
    )
    lines = _wrapped(
        f"coverage: {cov.run} of {cov.total} cases run ({_percent(cov.run_fraction)}); {applicable}", "", width
    )
    lines += _wrapped(
        f"{cov.skipped_capability} not applicable (capabilities {report.backend.name} does not declare), "
        f"{cov.skipped_environment} skipped for environment reasons",
        "  ",
        width,
    )
    if cov.selection or cov.deselected:
        lines += _wrapped(
            f"selected by {cov.selection!r}: {cov.deselected} cases of the suite not selected", "  ", width
        )
    if cov.not_exercised:
        lines.append("not exercised:")
        for i, group in enumerate(cov.not_exercised, 1):
            head = f"[{i}] {group.capability or 'environment'}, {group.cases} case{'s' * (group.cases != 1)}: "
            lines += _wrapped(head + group.reason, "  ", width, hang=" " * 4)
    return lines


def verdict(report: ConformanceReport) -> str:
    """One line: conformant or not, on how many cases, and what was not exercised."""
    s, cov, name = report.summary, report.coverage, report.backend.name
    scope = f"{cov.run} of {cov.total} cases ({_percent(cov.run_fraction)} run)"
    if cov.deselected:
        scope += f", {cov.deselected} not selected"
    if s.conformant:
        line = f"{name} is conformant on {scope}"
    else:
        line = f"{name} is NOT conformant: {s.failed} failed and {s.error} errors among {scope}"
    if cov.run == 0:
        line += "; nothing was checked"
    if cov.not_exercised:
        line += "; not exercised: " + ", ".join(f"{_label(g)} ({g.cases})" for g in cov.not_exercised)
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepinfer_conformance.report", description=__doc__)
    parser.add_argument("--schema", nargs="?", const="-", metavar="PATH", help="print (or write) the JSON Schema")
    parser.add_argument("--validate", metavar="FILE", help="check a report against the model")
    args = parser.parse_args(argv)
    if args.schema:
        text = json.dumps(json_schema(), indent=2) + "\n"
        sys.stdout.write(text) if args.schema == "-" else Path(args.schema).write_text(text)
    if args.validate:
        try:
            report = ConformanceReport.model_validate_json(Path(args.validate).read_text())
        except ValidationError as err:
            print(f"{args.validate}: not a valid {REPORT_FORMAT} report:\n{err}", file=sys.stderr)
            return 1
        print(f"{args.validate}: valid {report.format} report; {verdict(report)}")
    if not (args.schema or args.validate):
        parser.print_usage()
        print(f"the shipped schema: {REPORT_SCHEMA}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
