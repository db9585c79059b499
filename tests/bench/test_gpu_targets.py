"""bench/gpu_targets.py reads gpu_decode.py's reports and judges issue #16's targets: met, missed by how much,
or not measured (and why), on reports written here with figures chosen so each verdict is known beforehand."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_targets.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_targets", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def decode(ms_by_batch: dict) -> dict:
    return {str(b): {"ms_per_step": ms} for b, ms in ms_by_batch.items()}


def report(default: dict, invariant: dict, hf: dict | None, bounds: dict, prefill: dict, hf_reason=None) -> dict:
    out = {
        "commit": "abc1234 (set by hand)",
        "workload": {"batches": sorted(default)},
        "decode": {"ours_default": decode(default), "ours_batch_invariant": decode(invariant)},
        "bound": {"decode": {str(b): {"bound_ms": ms} for b, ms in bounds.items()}},
        "prefill": {key: {"tokens_per_s": tps} for key, tps in prefill.items()},
        "hf": {"available": hf is not None, "reason": hf_reason},
    }
    if hf is not None:
        out["decode"]["hf"] = decode(hf)
    return out


def test_verdicts(tmp_path):
    v4 = report(
        default={1: 2.0, 16: 4.0, 64: 5.0},
        invariant={1: 2.2, 16: 4.8, 64: 5.0},  # 1.10 met, 1.20 missed, 1.00 met
        hf={16: 16.0, 64: 10.0},  # 4x met, 2x missed (by 3 / 2)
        bounds={1: 0.5, 64: 1.5},  # 0.25 of bound missed, 0.3 missed
        prefill={"ours_default": 120.0, "hf": 100.0},
    )
    v41 = report({1: 3.0, 16: 4.0, 64: 6.0}, {1: 3.0, 16: 4.0, 64: 6.0}, None, {1: 1.2, 64: 3.0},
                 {"ours_default": 50.0}, hf_reason="no baseline for this model")  # fmt: skip
    v3 = report({1: 5.0}, {1: 5.0}, None, {}, {"ours_default": 80.0, "hf": 100.0})
    for name, body in (("gpu_decode_v4_m.json", v4), ("gpu_decode_v41_m.json", v41), ("gpu_decode_m.json", v3)):
        (tmp_path / name).write_text(json.dumps(body))
    out = tmp_path / "targets.json"
    assert load_script().main(["--results", str(tmp_path), "--machine", "m", "--out", str(out)]) == 0
    rows = {r["id"]: r for r in json.loads(out.read_text())["targets"]}

    assert rows["v4_decode_vs_hf_batch16"]["status"] == "met"
    assert rows["v4_decode_vs_hf_batch64"]["status"] == "missed"
    assert rows["v4_decode_vs_hf_batch64"]["missed_by"] == 1.5
    assert rows["v4_decode_of_bound_batch1"]["status"] == "missed"
    assert abs(rows["v4_decode_of_bound_batch64"]["value"] - 0.3) < 1e-9
    assert [rows[f"v4_batch_invariant_batch{b}"]["status"] for b in (1, 16, 64)] == ["met", "missed", "met"]
    assert rows["v4_prefill_vs_hf"]["status"] == "met"
    assert rows["v4_decode_vs_hf_batch64"]["commit"] == "abc1234"
    assert rows["v4_decode_vs_hf_batch64"]["why"] == "not analysed yet"  # no guessed reason

    assert rows["v41_decode_vs_hf_batch16"]["status"] == "not measured"
    assert rows["v41_decode_vs_hf_batch16"]["reason"] == "no baseline for this model"
    assert rows["v41_decode_of_bound_batch64"]["status"] == "met"  # 3.0 / 6.0 = 0.5
    assert rows["v3_decode_batch1_ms"]["status"] == "missed" and rows["v3_decode_batch1_ms"]["missed_by"] == 2.0
    assert rows["v3_prefill_vs_hf"]["status"] == "missed" and rows["v3_prefill_vs_hf"]["missed_by"] == 1.25


def test_a_missing_report_is_not_measured(tmp_path):
    out = tmp_path / "targets.json"
    assert load_script().main(["--results", str(tmp_path), "--machine", "m", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["summary"]["met"] == 0 and result["summary"]["missed"] == 0
    assert all(r["status"] == "not measured" and "missing" in r["reason"] for r in result["targets"])
