"""The `deepinfer backends` command, run as the installed console script in a subprocess."""

from __future__ import annotations

import json


def assert_clean_error(result, *fragments):
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    assert result.stderr.startswith("deepinfer: error: ")
    for fragment in fragments:
        assert fragment in result.stderr, (fragment, result.stderr)


def test_backends_table_lists_cpu_available_and_vendors_with_reasons(run_cli):
    result = run_cli(["backends"])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:4] == ["BACKEND", "DISTRIBUTION", "PRIORITY", "STATUS"]
    cpu = next(line for line in lines if line.startswith("cpu "))
    assert " available" in cpu and "deepinfer 0.1.0" in cpu
    ascend_at = next(i for i, line in enumerate(lines) if line.startswith("ascend950 (ascend)"))
    assert "unavailable" in lines[ascend_at] and "torch_npu is not installed" in lines[ascend_at + 1]
    assert any(line.startswith("nvidia_sm100 (nvidia)") and "unavailable" in line for line in lines)


def test_backends_json(run_cli):
    report = json.loads(run_cli(["backends", "--json"]).stdout)
    assert report["contract_api_version"] == 1
    rows = {row["name"]: row for row in report["backends"]}
    assert rows["cpu"]["available"] is True and rows["cpu"]["capabilities"]["dtypes"] == ["float32", "bfloat16"]
    assert rows["ascend950"]["available"] is False and rows["ascend950"]["aliases"] == ["ascend"]
    assert rows["nvidia_sm100"]["distribution"] == "deepinfer-nvidia-sm100"


def test_select_auto_picks_cpu_here(run_cli):
    for env in ({}, {"DEEPINFER_ACCELERATOR": "auto"}):
        result = run_cli(["backends", "--select"], env=env)
        assert result.returncode == 0 and result.stdout.startswith("cpu "), result


def test_select_ascend_without_npu_fails_with_reason_and_alternatives(run_cli):
    result = run_cli(["backends", "--select"], env={"DEEPINFER_ACCELERATOR": "ascend"})
    assert_clean_error(result, "ascend950 is not available", "torch_npu is not installed", "Available here: cpu")


def test_select_nvidia_without_gpu_fails_cleanly(run_cli):
    result = run_cli(["backends", "--select", "--accelerator", "nvidia"])
    assert_clean_error(result, "nvidia_sm100 is not available", "Available here: cpu")


def test_unknown_accelerator_lists_installed(run_cli):
    result = run_cli(["backends", "--select"], env={"DEEPINFER_ACCELERATOR": "tpu"})
    assert_clean_error(result, "unknown backend 'tpu'", "cpu: available", "ascend950 (alias ascend)")


def test_broken_plugins_are_shown_and_do_not_break_the_command(run_cli, install_distributions):
    site = install_distributions("test_backends", "test_broken")
    result = run_cli(["backends"], site=site)
    assert result.returncode == 0, result.stderr
    assert "broken plugins (not loaded; everything else works):" in result.stdout
    for name in ("import_error", "bad_signature", "old_contract", "unknown_hook", "no_version", "broken_plugin"):
        assert f"] {name} (deepinfer-test-broken 0.0.1)" in result.stdout
    assert "Traceback" not in result.stdout
    verbose = run_cli(["backends", "--verbose"], site=site)
    assert "ModuleNotFoundError: No module named 'deepinfer_vendor_sdk_that_does_not_exist'" in verbose.stdout
    selected = run_cli(["backends", "--select"], site=site)
    assert selected.stdout.startswith("fakeaccel "), selected
    report = json.loads(run_cli(["backends", "--json"], site=site).stdout)
    broken = {row["name"]: row for row in report["broken"]}
    assert "contract version 999" in broken["old_contract"]["error"]
    assert "deepinfer_vendor_sdk_that_does_not_exist" in broken["import_error"]["traceback"]


def test_selecting_a_broken_backend_is_a_clean_error(run_cli, install_distributions):
    result = run_cli(
        ["backends", "--select", "--accelerator", "old_contract"], site=install_distributions("test_broken")
    )
    assert_clean_error(result, "installed but failed to load", "contract version 999")


def test_serve_on_an_unavailable_accelerator_fails_cleanly(run_cli):
    result = run_cli(["serve", "--port", "0"], env={"DEEPINFER_ACCELERATOR": "ascend"})
    assert_clean_error(result, "ascend950 is not available", "torch_npu is not installed", "Available here: cpu")
