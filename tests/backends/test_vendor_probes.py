"""The in-tree vendor backends' probes: precise reasons, and no vendor runtime imported to get them."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from deepinfer_ascend950 import plugin as ascend
from deepinfer_nvidia_sm100 import plugin as nvidia

PROBE_IN_SUBPROCESS = """
import json, sys, torch
from deepinfer_core.backend.registry import discover
rows = {b.name: b.reason for b in discover().backends}
print(json.dumps({"reasons": rows, "triton": "triton" in sys.modules, "torch_npu": "torch_npu" in sys.modules,
                  "cuda_initialized": torch.cuda.is_initialized()}))
"""


def probe_in_subprocess(site=None, env=None):
    import os

    full_env = dict(os.environ, **(env or {}))
    if site is not None:
        full_env["PYTHONPATH"] = str(site)
    result = subprocess.run(
        [sys.executable, "-c", PROBE_IN_SUBPROCESS], capture_output=True, text=True, env=full_env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_discovery_imports_no_vendor_runtime():
    report = probe_in_subprocess()
    assert not report["triton"] and not report["torch_npu"] and not report["cuda_initialized"]
    assert "torch_npu is not installed" in report["reasons"]["ascend950"]


@pytest.fixture
def fake_torch_npu(tmp_path):
    """A torch_npu whose import fails like the real one without CANN (libhccl.so missing)."""
    package = tmp_path / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('libhccl.so: cannot open shared object file')\n")
    return tmp_path


def test_ascend_probe_checks_cann_before_importing_torch_npu(fake_torch_npu, tmp_path):
    no_cann = probe_in_subprocess(fake_torch_npu, {"ASCEND_HOME_PATH": "", "ASCEND_TOOLKIT_HOME": ""})
    assert no_cann["reasons"]["ascend950"].startswith("CANN toolkit not found")
    assert not no_cann["torch_npu"]
    with_cann = probe_in_subprocess(fake_torch_npu, {"ASCEND_HOME_PATH": str(tmp_path)})
    if not with_cann["reasons"]["ascend950"].startswith("no NPU visible: no /dev/davinci"):
        pytest.skip("this machine has /dev/davinci device nodes")
    assert not with_cann["torch_npu"]


def test_ascend_probe_reports_a_failing_torch_npu_import(fake_torch_npu, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(fake_torch_npu))
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path))
    monkeypatch.setattr(ascend.glob, "glob", lambda pattern: ["/dev/davinci0"])  # pretend a device node exists
    probe = ascend.deepinfer_backend_probe()
    assert not probe.available
    assert probe.reason == "torch_npu failed to initialise: ImportError: libhccl.so: cannot open shared object file"


def _fake_gpu(monkeypatch, *, major, minor, triton=True):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    props = SimpleNamespace(name="Test GPU", major=major, minor=minor)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    real_find_spec = nvidia.importlib.util.find_spec
    monkeypatch.setattr(
        nvidia.importlib.util,
        "find_spec",
        lambda name: (object() if triton else None) if name == "triton" else real_find_spec(name),
    )


def test_nvidia_probe_on_this_cpu_build():
    if torch.version.cuda is not None:
        pytest.skip("torch here is a CUDA build")
    probe = nvidia.deepinfer_backend_probe()
    assert not probe.available and "is not a CUDA build" in probe.reason


def test_nvidia_probe_without_a_visible_gpu(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert nvidia.deepinfer_backend_probe().reason == "no NVIDIA GPU visible (CUDA_VISIBLE_DEVICES='')"


def test_nvidia_probe_refuses_pre_hopper_gpus(monkeypatch):
    _fake_gpu(monkeypatch, major=8, minor=0)
    probe = nvidia.deepinfer_backend_probe()
    assert not probe.available and "compute capability 8.0; this backend needs 9.0" in probe.reason


def test_nvidia_probe_needs_triton(monkeypatch):
    _fake_gpu(monkeypatch, major=9, minor=0, triton=False)
    assert "triton is not installed" in nvidia.deepinfer_backend_probe().reason


@pytest.mark.parametrize(("major", "paths"), [(9, "SM90 paths"), (10, "SM100 paths")])
def test_nvidia_probe_reports_the_gpu(monkeypatch, major, paths):
    _fake_gpu(monkeypatch, major=major, minor=0)
    probe = nvidia.deepinfer_backend_probe()
    assert probe.available and probe.reason.startswith(f"Test GPU, compute capability {major}.0")
    assert paths in probe.reason and dict(probe.facts)["gpu"] == "Test GPU"
