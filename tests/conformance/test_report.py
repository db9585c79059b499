"""The report model in process: coverage and what was not exercised, the table (reasons whole, never cut),
the closing verdict line, and the shipped JSON Schema (equal to the model's, and real reports fit it)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from deepinfer_conformance import REPORT_FORMAT, REPORT_SCHEMA
from deepinfer_conformance.report import (
    ConformanceReport,
    Skip,
    build_report,
    case_report,
    format_table,
    json_schema,
    verdict,
    write_report,
)
from deepinfer_core.backend.registry import discover
from deepinfer_core.backend.selection import select_backend

FAILURE_DETAIL = " ".join(f"element{i}: 0.5 vs 0.7" for i in range(12))  # 200 characters in one line
LONG_REASON = (
    "sparsebackend does not declare 'torch_distributed:gloo' in Capabilities.communicators (it lists "
    "in_process); multi-process dispatch is tested over gloo, so these cases need a gloo world of CPU processes"
)


@pytest.fixture(scope="module")
def cpu():
    return select_backend(discover(), "cpu")


def capability_skip(case: str, capability: str, reason: str):
    return case_report(case, "skipped", reason, {}, 0.001, Skip(kind="capability", capability=capability))


def sparse_run() -> list:
    """Two cases run out of ten: the rest skipped for what the backend does not declare, and one for the
    environment."""
    cases = [
        case_report("ops::test_rms_norm[64-torch.float32]", "passed", "", _close(1e-7), 0.01),
        case_report(
            "ops::test_linear[64-torch.float32]",
            "failed",
            "output: Tensor-likes are not close!\n" + FAILURE_DETAIL,
            {},
            0,
        ),
    ]
    cases += [capability_skip(f"ops::test_rms_norm[{n}-torch.bfloat16]", "dtypes:bfloat16", "no bf16") for n in (1, 7)]
    cases += [
        capability_skip(f"batch_invariance::test_batch_invariance[{n}]", "batch_invariant", "no claim")
        for n in range(3)
    ]
    cases += [
        capability_skip(f"dispatch::test_world2[{n}]", "communicators:torch_distributed:gloo", LONG_REASON)
        for n in range(2)
    ]
    cases.append(
        case_report(
            "dispatch::test_spawn",
            "skipped",
            "this torch build has no torch.distributed",
            {},
            0,
            Skip(kind="environment"),
        )
    )
    return cases


def _close(err: float) -> dict:
    return {"max_abs_err": err, "max_rel_err": err, "tolerance": {"rtol": 1.3e-6, "atol": 1e-5}, "runs": (1, 2)}


def test_coverage_counts_what_ran_and_groups_what_did_not(cpu):
    report = build_report(cpu, sparse_run(), 1.0, deselected=5, selection="ops or dispatch")
    cov = report.coverage
    assert (cov.total, cov.run, cov.skipped_capability, cov.skipped_environment) == (10, 2, 7, 1)
    assert cov.applicable == 3 and cov.run_fraction == 0.2 and cov.applicable_run_fraction == round(2 / 3, 4)
    assert [(g.kind, g.capability, g.cases) for g in cov.not_exercised] == [
        ("capability", "batch_invariant", 3),
        ("capability", "dtypes:bfloat16", 2),
        ("capability", "communicators:torch_distributed:gloo", 2),
        ("environment", None, 1),
    ]
    assert cov.not_exercised[2].reason == LONG_REASON
    assert report.summary.conformant is False and (report.summary.failed, report.summary.skipped) == (1, 8)
    assert report.cases[0].metrics == {"runs": [1, 2]} and report.cases[0].tolerance.rtol == 1.3e-6


def test_conformant_is_never_printed_without_its_coverage(cpu):
    cases = [c for c in sparse_run() if c.status != "failed"]
    line = verdict(build_report(cpu, cases, 1.0))
    assert line.startswith("cpu is conformant on 1 of 9 cases (11% run); not exercised: batch_invariant (3), ")
    assert (
        "communicators:torch_distributed:gloo (2), environment: this torch build has no torch.distributed (1)" in line
    )
    nothing = verdict(build_report(cpu, [c for c in cases if c.status == "skipped"], 1.0))
    assert "conformant on 0 of 8 cases (0% run); nothing was checked" in nothing
    failing = verdict(build_report(cpu, sparse_run(), 1.0, deselected=400))
    assert failing.startswith("cpu is NOT conformant: 1 failed and 0 errors among 2 of 10 cases (20% run), 400 not")


def test_the_table_shows_coverage_and_every_reason_whole(cpu):
    report = build_report(cpu, sparse_run(), 1.0, deselected=5, selection="ops or dispatch")
    table = format_table(report, width=80)
    assert all(
        len(line) <= 80 for line in table.splitlines() if not line.startswith(("ops::", "dispatch::", "batch", "CASE"))
    )
    flat = " ".join(table.split())
    assert " ".join(LONG_REASON.split()) in flat  # wrapped, not cut
    assert FAILURE_DETAIL in flat  # a failure message, whole, under its row
    assert "coverage: 2 of 10 cases run (20%); 2 of 3 applicable (67%)" in table
    assert "7 not applicable (capabilities cpu does not declare), 1 skipped for environment reasons" in flat
    assert "selected by 'ops or dispatch': 5 cases of the suite not selected" in flat
    world = next(line for line in table.splitlines() if line.startswith("dispatch::test_world2[0]"))
    assert world.split()[-1] == "[3]" and "[3] communicators:torch_distributed:gloo, 2 cases: " in table


def test_the_shipped_schema_is_the_models():
    shipped = json.loads(REPORT_SCHEMA.read_text())
    assert shipped == json_schema(), (
        "report.schema.json is stale; regenerate it: "
        "python -m deepinfer_conformance.report --schema conformance/deepinfer_conformance/report.schema.json"
    )
    assert shipped["properties"]["format"]["const"] == REPORT_FORMAT
    assert {"coverage", "summary", "backend", "machine", "cases"} <= set(shipped["required"])


def validate(instance: dict) -> None:
    """Against the shipped schema with jsonschema when installed, else against the model."""
    try:
        import jsonschema
    except ImportError:
        ConformanceReport.model_validate_json(json.dumps(instance))
    else:
        jsonschema.Draft202012Validator(json.loads(REPORT_SCHEMA.read_text())).validate(instance)


def test_written_reports_validate_and_tampered_ones_do_not(cpu, tmp_path):
    path = tmp_path / "report.json"
    write_report(build_report(cpu, sparse_run(), 1.0), path)
    written = json.loads(path.read_text())
    validate(written)
    assert written["format"] == REPORT_FORMAT and written["coverage"]["not_exercised"][0]["cases"] == 3
    for broken in (
        {**written, "format": "deepinfer-conformance/1"},
        {**written, "coverage": {k: v for k, v in written["coverage"].items() if k != "run"}},
        {**written, "summary": {**written["summary"], "surprise": 1}},
    ):
        with pytest.raises(Exception, match="format|run|surprise"):
            validate(broken)


def test_the_module_prints_the_schema_and_validates_a_report(cpu, tmp_path):
    printed = subprocess.run(
        [sys.executable, "-m", "deepinfer_conformance.report", "--schema"], capture_output=True, text=True, check=True
    )
    assert json.loads(printed.stdout) == json_schema()
    path = tmp_path / "report.json"
    write_report(build_report(cpu, sparse_run(), 1.0), path)
    checked = subprocess.run(
        [sys.executable, "-m", "deepinfer_conformance.report", "--validate", str(path)], capture_output=True, text=True
    )
    assert checked.returncode == 0 and "valid deepinfer-conformance/2 report; cpu is NOT conformant" in checked.stdout
    path.write_text(path.read_text().replace('"run":', '"ran":'))
    rejected = subprocess.run(
        [sys.executable, "-m", "deepinfer_conformance.report", "--validate", str(path)], capture_output=True, text=True
    )
    assert rejected.returncode == 1 and "not a valid deepinfer-conformance/2 report" in rejected.stderr
