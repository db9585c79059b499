"""Fixtures for the Hugging Face parity tests: tiny random DeepSeek-V3 / V4 checkpoints built with transformers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_HELPER = "deepinfer_tests_hf_checkpoints"


def _helper(name: str = _HELPER, file: str = "hf_checkpoints.py"):
    """A helper file of tests/model as one module per process (tests/engine loads the same one)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(file))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """hf_checkpoint("a" | "b") -> Checkpoint(variant, path, hf_model): saved with save_pretrained, built once."""
    pytest.importorskip("transformers")
    helper = _helper()
    root = tmp_path_factory.mktemp("hf-deepseek-v3")
    return lambda variant: helper.build_checkpoint(variant, root)


@pytest.fixture(scope="session")
def hf_v4_checkpoint(tmp_path_factory):
    """hf_v4_checkpoint("a" | "b") -> Checkpoint(variant, path, hf_model) of a tiny DeepSeek-V4."""
    pytest.importorskip("transformers")
    helper = _helper("deepinfer_tests_hf_v4_checkpoints", "hf_v4_checkpoints.py")
    root = tmp_path_factory.mktemp("hf-deepseek-v4")
    return lambda variant: helper.build_v4_checkpoint(variant, root)
