"""The conformance suite itself: it passes the reference, fails a wrong backend loudly, and reports skips
with the backend's reason. Runs `deepinfer conformance` as users do, in a subprocess."""

from __future__ import annotations

import json


def conformance(run_cli, tmp_path, backend, *extra, site=None):
    report = tmp_path / f"{backend}.json"
    result = run_cli(["conformance", "--backend", backend, "--report", str(report), *extra], site=site)
    return result, (json.loads(report.read_text()) if report.exists() else None)


def cases(report, status):
    return {c["case"]: c for c in report["cases"] if c["status"] == status}


def test_the_reference_passes_and_the_report_is_complete(run_cli, tmp_path):
    result, report = conformance(run_cli, tmp_path, "cpu", "-k", "rms_norm or moe_route")
    assert result.returncode == 0, result.stdout[-3000:]
    assert report["format"] == "deepinfer-conformance/1" and report["summary"]["conformant"] is True
    assert report["backend"]["name"] == "cpu" and report["backend"]["distribution"] == "deepinfer"
    assert {"host", "platform", "torch"} <= set(report["machine"])
    case = next(c for c in report["cases"] if c["case"].startswith("ops::test_rms_norm"))
    assert {"max_abs_err", "max_rel_err", "tolerance", "duration_s"} <= set(case)
    assert "CASE" in result.stdout and "report written to" in result.stdout


def test_a_nonconformant_backend_fails_and_the_report_names_the_cases(run_cli, install_distributions, tmp_path):
    site = install_distributions("nonconformant")
    result, report = conformance(
        run_cli, tmp_path, "nonconformant", "-k", "rms_norm or linear or batch_invariance", site=site
    )
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


def test_unsupported_features_are_skipped_with_the_backends_reason(run_cli, install_distributions, tmp_path):
    site = install_distributions("test_backends")
    result, report = conformance(run_cli, tmp_path, "fakeaccel", "-k", "expert_ffn or rms_norm", site=site)
    assert result.returncode == 0, result.stdout[-3000:]
    skipped = cases(report, "skipped")
    ffn = [c for name, c in skipped.items() if "expert_ffn" in name]
    assert ffn and all(
        c["reason"] == "fakeaccel does not support expert_ffn: no grouped GEMM on the fake device" for c in ffn
    )
    assert any("does not compute in bfloat16" in c["reason"] for c in skipped.values())
    assert cases(report, "passed")  # float32 rms_norm still ran


def test_an_unknown_backend_is_a_clean_error(run_cli, tmp_path):
    result, report = conformance(run_cli, tmp_path, "tpu")
    assert result.returncode == 2 and report is None
    assert "unknown backend 'tpu'" in result.stderr and "Traceback" not in result.stderr
