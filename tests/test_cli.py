"""The `deepinfer backends` command, run as the installed console script in a subprocess; selection
messages; `deepinfer conformance` without pytest."""

from __future__ import annotations

import json
import sys

from deepinfer_core.cli import main


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
        if not env:  # and says the default asked (other sources: test_select_says_where_the_request_came_from)
            assert "(requested 'auto' by the default;" in result.stdout


def test_select_ascend_without_npu_fails_with_reason_and_alternatives(run_cli):
    result = run_cli(["backends", "--select"], env={"DEEPINFER_ACCELERATOR": "ascend"})
    assert_clean_error(result, "ascend950 is not available", "torch_npu is not installed", "Available here: cpu")


def test_select_nvidia_without_gpu_fails_cleanly(run_cli):
    result = run_cli(["backends", "--select", "--accelerator", "nvidia"])
    assert_clean_error(result, "nvidia_sm100 is not available", "Available here: cpu")


def test_an_unknown_accelerator_lists_installed_and_names_where_it_came_from(run_cli):
    from_env = run_cli(["backends", "--select"], env={"DEEPINFER_ACCELERATOR": "tpu"})
    assert_clean_error(from_env, "unknown backend 'tpu' (from $DEEPINFER_ACCELERATOR=tpu)", "Set DEEPINFER_ACCELERATOR")
    assert_clean_error(from_env, "cpu: available", "ascend950 (alias ascend)")  # the installed ones
    assert "--accelerator" not in from_env.stderr
    # the flag wins over the variable, and the message says the flag
    for command in (["backends", "--select"], ["serve", "--port", "0"]):
        from_flag = run_cli([*command, "--accelerator", "nosuch"], env={"DEEPINFER_ACCELERATOR": "cpu"})
        assert_clean_error(from_flag, "unknown backend 'nosuch' (from --accelerator)", "to --accelerator")
        assert "DEEPINFER_ACCELERATOR" not in from_flag.stderr
    unavailable = run_cli(["backends", "--select", "--accelerator", "ascend"])
    assert_clean_error(unavailable, "ascend950 is not available", "It was asked for by --accelerator.")


def test_select_says_where_the_request_came_from(run_cli):
    # the default as the source: checked in test_select_auto_picks_cpu_here, on its run of the same command
    assert "(requested 'cpu' by $DEEPINFER_ACCELERATOR=cpu;" in (
        run_cli(["backends", "--select"], env={"DEEPINFER_ACCELERATOR": "cpu"}).stdout
    )
    chosen = json.loads(run_cli(["backends", "--select", "--json", "--accelerator", "cpu"]).stdout)
    assert (chosen["requested"], chosen["source"]) == ("cpu", "--accelerator")


def test_long_reasons_are_wrapped_whole_not_cut(run_cli):
    result = run_cli(["backends"], env={"COLUMNS": "60"})  # the table is never narrower than 80
    lines = result.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("ascend950 (ascend)"))
    reason = []
    for line in lines[at + 1 :]:
        if not line.startswith("    "):
            break
        assert len(line) <= 80, line
        reason.append(line.strip())
    assert len(reason) > 1  # this reason is longer than a line
    assert " ".join(reason).endswith("pip install 'deepinfer-ascend950[npu]')")


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


def test_conformance_without_pytest_says_exactly_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pytest", None)  # `import pytest` fails as on a plain install
    assert main(["conformance", "--backend", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("deepinfer: error: `deepinfer conformance` runs the suite under pytest, which this Python")
    assert f"Install deepinfer's conformance extra (pytest>=8):\n    {sys.executable} -m pip install " in err
    assert "[conformance]'" in err and "Traceback" not in err
