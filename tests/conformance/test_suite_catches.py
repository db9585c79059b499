"""The conformance suite itself: it passes the reference, fails a wrong backend loudly, and reports skips
with the backend's reason and the coverage the verdict rests on. Runs `deepinfer conformance` as users do,
in a subprocess."""

from __future__ import annotations

import json

import pytest

from deepinfer_conformance.report import ConformanceReport


def conformance(run_cli, tmp_path, backend, *extra, site=None, env=None):
    report = tmp_path / f"{backend}.json"
    args = ["conformance", "--report", str(report), *extra]
    result = run_cli(args if backend is None else [args[0], "--backend", backend, *args[1:]], site=site, env=env)
    if not report.exists():
        return result, None
    ConformanceReport.model_validate_json(report.read_text())  # every report the CLI writes fits the model
    return result, json.loads(report.read_text())


def last_line(result) -> str:
    return result.stdout.rstrip().splitlines()[-1]


def cases(report, status):
    return {c["case"]: c for c in report["cases"] if c["status"] == status}


def test_the_reference_passes_and_the_report_is_complete(run_cli, tmp_path):
    result, report = conformance(run_cli, tmp_path, "cpu", "-k", "rms_norm or moe_route")
    assert result.returncode == 0, result.stdout[-3000:]
    assert report["format"] == "deepinfer-conformance/2" and report["summary"]["conformant"] is True
    assert report["backend"]["name"] == "cpu" and report["backend"]["distribution"] == "deepinfer"
    assert {"host", "platform", "torch"} <= set(report["machine"])
    case = next(c for c in report["cases"] if c["case"].startswith("ops::test_rms_norm"))
    assert {"max_abs_err", "max_rel_err", "tolerance", "duration_s"} <= set(case)
    assert "CASE" in result.stdout and "report written to" in result.stdout
    coverage = report["coverage"]
    assert coverage["run"] == report["summary"]["passed"] == coverage["total"] > 0  # cpu declares all it is asked
    assert coverage["applicable_run_fraction"] == 1.0 and coverage["not_exercised"] == []
    assert coverage["selection"] == "rms_norm or moe_route" and coverage["deselected"] > 300
    n = coverage["run"]
    assert last_line(result).startswith(f"deepinfer conformance: cpu is conformant on {n} of {n} cases (100% run)")


def test_a_nonconformant_backend_fails_and_the_report_names_the_cases(run_cli, install_distributions, tmp_path):
    site = install_distributions("nonconformant")
    # its batch-invariance claim checked on one model and dtype: 5 end-to-end cases, not all 20 (~100 s less
    # on 2 cores), the batch-dependent linear breaking each; `test_linear`, not `linear`: dispatch's
    # combine_linear_experts cases pass on it and start gloo worlds of 2 and 4 processes
    selection = "rms_norm or test_linear or (batch_invariance and v4 and float32)"
    result, report = conformance(run_cli, tmp_path, "nonconformant", "-k", selection, site=site)
    assert result.returncode == 1, result.stdout[-3000:]
    assert report["summary"]["conformant"] is False
    failed = cases(report, "failed")
    assert any(name.startswith("ops::test_rms_norm") for name in failed), list(failed)
    assert any(name.startswith("ops::test_linear") for name in failed), list(failed)
    variance = [c for name, c in failed.items() if name.startswith("batch_invariance::")]
    assert variance and all("batch invariance violated" in c["reason"] for c in variance)  # held to its claim
    assert all(c["reason"] for c in failed.values())  # every failure carries its error
    assert "Tensor-likes are not close" in next(c for n, c in failed.items() if "rms_norm" in n)["reason"]
    assert "failed" in result.stdout and "nonconformant" in json.dumps(report["backend"])
    summary = report["summary"]
    assert last_line(result).startswith(
        f"deepinfer conformance: nonconformant is NOT conformant: {summary['failed']} failed and 0 errors among "
    )
    # the table shows each failure's message whole under its row (it used to cut it at 100 characters)
    table = result.stdout.split("deepinfer conformance =", 1)[1].split("report written to")[0]
    long_failure = max((c["reason"] for c in failed.values()), key=len)
    assert len(long_failure) > 100 and " ".join(long_failure.split()) in " ".join(table.split())


@pytest.fixture(scope="module")
def fakeaccel_run(run_cli, install_distributions, tmp_path_factory):
    """(result, report) of one run on fakeaccel, read by the two tests below (a run is ~6 s of startup)."""
    site = install_distributions("test_backends")
    return conformance(
        run_cli, tmp_path_factory.mktemp("fakeaccel"), "fakeaccel", "-k", "expert_ffn or rms_norm", site=site
    )


def test_unsupported_features_are_skipped_with_the_backends_reason(fakeaccel_run):
    result, report = fakeaccel_run
    assert result.returncode == 0, result.stdout[-3000:]
    skipped = cases(report, "skipped")
    ffn = [c for name, c in skipped.items() if "expert_ffn" in name]
    assert ffn and all(
        c["reason"] == "fakeaccel does not support expert_ffn: no grouped GEMM on the fake device" for c in ffn
    )
    assert all(c["skip"] == {"kind": "capability", "capability": "unsupported:expert_ffn"} for c in ffn)
    assert any("does not compute in bfloat16" in c["reason"] for c in skipped.values())
    assert cases(report, "passed")  # float32 rms_norm still ran


def test_coverage_shows_how_little_a_sparse_backend_was_checked(fakeaccel_run):
    """fakeaccel computes only in float32 and has no expert_ffn: `conformant` alone would hide that most of
    the selected cases never ran, so the report, the table and the last line all carry the coverage."""
    result, report = fakeaccel_run
    summary, coverage = report["summary"], report["coverage"]
    assert summary["conformant"] is True and summary["passed"] == coverage["run"]
    assert coverage["run"] + summary["skipped"] == coverage["total"] == summary["total"]
    assert coverage["run_fraction"] < 0.5, coverage  # most of what was selected did not run
    assert coverage["skipped_capability"] == coverage["total"] - coverage["applicable"] > coverage["run"]
    assert coverage["applicable_run_fraction"] == round(coverage["run"] / coverage["applicable"], 4)
    groups = {g["capability"]: g for g in coverage["not_exercised"] if g["kind"] == "capability"}
    assert {"unsupported:expert_ffn", "dtypes:bfloat16"} <= set(groups)
    assert groups["unsupported:expert_ffn"]["reason"].endswith("no grouped GEMM on the fake device")
    assert sum(g["cases"] for g in coverage["not_exercised"]) == summary["skipped"]
    percent = f"{coverage['run_fraction']:.0%}"
    assert f"coverage: {coverage['run']} of {coverage['total']} cases run ({percent})" in result.stdout
    assert "no grouped GEMM on the fake device" in result.stdout.split("not exercised:")[1]
    line = last_line(result)
    assert line.startswith(f"deepinfer conformance: fakeaccel is conformant on {coverage['run']} of ")
    assert "not exercised: " in line and "unsupported:expert_ffn (" in line and "dtypes:bfloat16 (" in line


def test_an_unknown_backend_is_a_clean_error_naming_where_it_came_from(run_cli, tmp_path):
    result, report = conformance(run_cli, tmp_path, "tpu")
    assert result.returncode == 2 and report is None
    assert "unknown backend 'tpu' (from --backend)" in result.stderr and "Traceback" not in result.stderr
    assert "DEEPINFER_ACCELERATOR" not in result.stderr and "Pass one of these names or `auto` to --backend" in (
        result.stderr
    )
    result, report = conformance(run_cli, tmp_path, None, env={"DEEPINFER_ACCELERATOR": "tpu"})
    assert result.returncode == 2 and report is None
    assert "unknown backend 'tpu' (from $DEEPINFER_ACCELERATOR=tpu)" in result.stderr
    assert "--backend" not in result.stderr
