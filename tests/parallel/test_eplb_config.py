"""EPLB's settings (deepinfer_core/parallel/eplb_runtime.EplbConfig): vLLM's keys, DeepSeek's per-phase
defaults, and clear errors."""

from __future__ import annotations

import pytest

from deepinfer_core.errors import DeepInferError
from deepinfer_core.parallel.eplb_runtime import EplbConfig


def test_the_default_is_deepseeks_decode_setting():
    config = EplbConfig.parse(None)
    assert (config.window_size, config.step_interval, config.redundant_experts(8)) == (1000, 10000, 8)


def test_the_prefill_phase_takes_deepseeks_prefill_setting_where_keys_are_not_given():
    config = EplbConfig.parse({"phase": "prefill"})
    assert (config.window_size, config.step_interval, config.redundant_experts(8)) == (100, 1000, 32)
    mixed = EplbConfig.parse({"phase": "prefill", "step_interval": 50, "num_redundant_experts": 3})
    assert (mixed.window_size, mixed.step_interval, mixed.redundant_experts(8)) == (100, 50, 3)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"window": 3}, r"unknown keys \['window'\]"),
        ({"phase": "train"}, "phase must be one of"),
        ({"window_size": 0}, "window_size must be a positive integer"),
        ({"step_interval": True}, "step_interval must be a positive integer"),
        ({"num_redundant_experts": -1}, "num_redundant_experts must be 0 or more"),
    ],
)
def test_bad_settings_are_named(raw, message):
    with pytest.raises(DeepInferError, match=message):
        EplbConfig.parse(raw)
