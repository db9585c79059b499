"""Fixtures for the Hugging Face parity tests: tiny random DeepSeek-V3 checkpoints built with transformers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_HELPER = "deepinfer_tests_hf_checkpoints"


def _helper():
    """tests/model/hf_checkpoints.py as one module per process (tests/engine loads the same one)."""
    if _HELPER not in sys.modules:
        spec = importlib.util.spec_from_file_location(_HELPER, Path(__file__).with_name("hf_checkpoints.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[_HELPER] = module
        spec.loader.exec_module(module)
    return sys.modules[_HELPER]


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """hf_checkpoint("a" | "b") -> Checkpoint(variant, path, hf_model): saved with save_pretrained, built once."""
    pytest.importorskip("transformers")
    helper = _helper()
    root = tmp_path_factory.mktemp("hf-deepseek-v3")
    return lambda variant: helper.build_checkpoint(variant, root)
