"""Discovery and selection through real installed distributions (tests/distributions), in process."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.backend import WallClockStepTimer
from deepinfer_core.backend.registry import discover
from deepinfer_core.backend.resolve import resolve_backend
from deepinfer_core.backend.selection import select_backend
from deepinfer_core.errors import BackendSelectionError
from deepinfer_core.parallel.communicator import InProcessCommunicator
from deepinfer_core.sampling.sampler import TorchSampler


@pytest.fixture
def site(install_distributions, monkeypatch):
    """Put an install of the named test distributions on sys.path for this test."""
    monkeypatch.delenv("DEEPINFER_ACCELERATOR", raising=False)

    def activate(*names: str):
        monkeypatch.syspath_prepend(str(install_distributions(*names)))
        return discover()

    return activate


def by_name(discovery):
    return {b.name: b for b in discovery.backends}


def broken_by_name(discovery):
    return {p.origin.name: p for p in discovery.broken}


def test_builtin_backends_with_honest_reasons(site):
    backends = by_name(site())
    assert backends["cpu"].available and backends["cpu"].origin.distribution == "deepinfer"
    nvidia, ascend = backends["nvidia_sm100"], backends["ascend950"]
    assert not nvidia.available and not ascend.available
    assert "torch_npu is not installed" in ascend.reason
    assert nvidia.origin.distribution == "deepinfer-nvidia-sm100"
    # no GPU or NPU here: each says what is missing, and neither lacks a hook of the contract
    assert "not a CUDA build" in nvidia.reason or "no NVIDIA GPU" in nvidia.reason
    assert "does not implement" not in nvidia.reason and "does not implement" not in ascend.reason


def test_auto_selects_cpu_when_nothing_else_is_available(site):
    assert select_backend(site(), "auto").name == "cpu"


def test_auto_prefers_the_highest_priority_available_backend(site):
    discovery = site("test_backends")
    assert by_name(discovery)["offline"].info.priority > by_name(discovery)["fakeaccel"].info.priority
    assert select_backend(discovery, "auto").name == "fakeaccel"  # offline is higher but unavailable


def test_environment_variable_and_aliases(site, monkeypatch):
    discovery = site("test_backends")
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "fake")
    assert select_backend(discovery).name == "fakeaccel"
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "CPU")
    assert select_backend(discovery).name == "cpu"
    assert select_backend(discovery, "fakeaccel").name == "fakeaccel"  # explicit beats the variable


def test_distribution_and_version_come_from_the_installed_metadata(site):
    fake = by_name(site("test_backends"))["fakeaccel"]
    assert (fake.origin.distribution, fake.origin.version) == ("deepinfer-test-backends", "1.2.3")
    assert fake.origin.target == "deepinfer_test_backends.fakeaccel"


def test_unknown_name_lists_installed_backends(site):
    with pytest.raises(BackendSelectionError) as err:
        select_backend(site("test_backends"), "tpu")
    message = str(err.value)
    assert "unknown backend 'tpu'" in message
    for name in ("cpu", "fakeaccel", "offline", "nvidia_sm100 (alias nvidia)"):
        assert name in message


def test_unavailable_backend_gives_probe_reason_and_alternatives(site):
    discovery = site("test_backends")
    with pytest.raises(BackendSelectionError) as err:
        select_backend(discovery, "offline")
    assert "/dev/offline0 is missing" in str(err.value)
    assert "Available here: fakeaccel, cpu" in str(err.value)
    with pytest.raises(BackendSelectionError, match="torch_npu is not installed"):
        select_backend(discovery, "ascend")


def test_broken_plugins_are_isolated_and_explained(site):
    discovery = site("test_backends", "test_broken")
    broken = broken_by_name(discovery)
    assert "ModuleNotFoundError" in broken["import_error"].error
    assert "deepinfer_vendor_sdk_that_does_not_exist" in broken["import_error"].traceback
    bad = broken["bad_signature"].error
    assert "deepinfer_backend_ops(devce, dtype)" in bad
    assert "deepinfer_backend_ops(device, dtype, batch_invariant)" in bad
    assert "unknown argument(s) devce" in bad
    old = broken["old_contract"].error
    assert "contract version 999" in old and "speaks version 1" in old
    assert "deepinfer_backend_opz" in broken["unknown_hook"].error and "not a hook" in broken["unknown_hook"].error
    assert "does not declare DEEPINFER_API_VERSION" in broken["no_version"].error
    assert broken["broken_plugin"].origin.group == "deepinfer.plugins"
    # everything else still works
    backends = by_name(discovery)
    assert backends["cpu"].available and backends["fakeaccel"].available
    assert select_backend(discovery, "auto").name == "fakeaccel"
    assert not set(broken) & set(backends)


def test_a_raising_probe_is_a_reason_not_a_crash(site):
    raising = by_name(site("test_broken"))["raising_probe"]
    assert not raising.available
    assert raising.reason.startswith("probe raised OSError: driver handshake failed")


def test_selecting_a_broken_backend_says_it_failed_to_load(site):
    with pytest.raises(BackendSelectionError, match="bad_signature' is installed but failed to load"):
        select_backend(site("test_broken"), "bad_signature")


def test_general_plugins_are_loaded_and_collected(site):
    from deepinfer_core.backend.extensions import ModelRegistry

    discovery = site("test_plugins")
    assert [p.name for p in discovery.plugins] == ["banlist"]
    hook = discovery.plugin_manager.hook
    [processors] = hook.deepinfer_logits_processors(model_name="demo")
    logits = processors[0]([1], [], torch.zeros(4))
    assert logits[0] == float("-inf") and torch.equal(logits[1:], torch.zeros(3))
    [observers] = hook.deepinfer_observers()
    assert hasattr(observers[0], "on_step")
    registry = ModelRegistry()
    hook.deepinfer_register_models(registry=registry)
    assert registry.architectures() == ["TestBanlistForCausalLM"]


def test_resolve_calls_hooks_once_and_fills_optional_defaults(site):
    fake = by_name(site("test_backends"))["fakeaccel"]
    calls = []
    undo = fake.manager.add_hookcall_monitoring(lambda name, impls, kwargs: calls.append(name), lambda *a: None)
    try:
        resolved = resolve_backend(fake, dtype=torch.float32)
        build_calls = len(calls)
        x = torch.randn(3, 8)
        resolved.ops.rms_norm(x, torch.ones(8), 1e-6)
        resolved.ops.linear(x, torch.randn(4, 8))
    finally:
        undo()
    assert len(calls) == build_calls  # the op path never goes through pluggy
    assert resolved.kv_layout.block_size == 64  # the backend's own layout
    assert isinstance(resolved.sampler, TorchSampler) and isinstance(resolved.communicator, InProcessCommunicator)
    assert isinstance(resolved.step_timer, WallClockStepTimer)
    with pytest.raises(BackendSelectionError, match="does not compute in bfloat16; it supports float32"):
        resolve_backend(fake, dtype=torch.bfloat16)


def test_resolving_an_unavailable_backend_is_refused(site):
    with pytest.raises(BackendSelectionError, match="not available"):
        resolve_backend(by_name(site())["nvidia_sm100"])
