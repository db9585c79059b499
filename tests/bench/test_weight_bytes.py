"""bench/weight_bytes.py: V4 Flash / V4.1 Flash weight bytes in the released formats, per layer, against bf16, and
the formats' objects hold exactly the bytes their definitions promise."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")  # the V4 Flash config is transformers' DeepseekV4Config() (v41_cache_bytes)

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_released_formats_hold_their_promise_and_quarter_the_device_bytes(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    weight_bytes = importlib.import_module("weight_bytes")
    out = tmp_path / "w.json"
    assert weight_bytes.main(["--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["machine"]["cpu_count"]
    v4 = report["models"]["v4_flash"]
    assert v4["formats_hold_what_they_promise"] and v4["checked_shapes"]
    assert all(c["promised"] == c["held"] for c in v4["checked_shapes"].values())
    # a V4 Flash MoE layer: 256 experts x (w1, w3 [2048, 4096] + w2 [4096, 2048]) at 4.25 bits a weight
    assert v4["per_layer"]["2"]["mxfp4"] == 256 * 3 * 2048 * 4096 * 17 // 32
    assert v4["bytes_by_format"]["mxfp4"] == 43 * v4["per_layer"]["2"]["mxfp4"]
    assert sum(layer["total"] for layer in v4["per_layer"].values()) < v4["device_bytes"]  # + embedding, head
    assert 0.25 < v4["device_ratio_to_bf16"] < 0.3
    v41 = report["models"]["v41"]
    assert v41["fp8_block"] == [32, 32] and v41["engram_table_bytes_host"] > 0
    assert v41["formats_hold_what_they_promise"]
