"""bench/spec_planner_sim.py on made-up cost curves: with a flat step cost the planner verifies every draft
(adaptive = fixed), with a steep one it verifies fewer and gains; the report says the acceptance is simulated."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "spec_planner_sim.py"


def run(tmp_path: Path, ms_by_batch: dict[int, float]) -> dict:
    spec = importlib.util.spec_from_file_location("spec_planner_sim", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = tmp_path / "cost.json"
    report.write_text(
        json.dumps({"decode": {"ours_default": {str(b): {"ms_per_step": ms} for b, ms in ms_by_batch.items()}}})
    )
    out = tmp_path / "sim.json"
    args = ["--cost-report", str(report), "--batches", "16,32", "--steps", "30", "--out", str(out)]
    assert module.main([*args, "--plot", str(tmp_path / "sim.png")]) == 0
    return json.loads(out.read_text())


def test_flat_cost_verifies_every_draft(tmp_path):
    result = run(tmp_path, {1: 5.0, 1024: 5.0})
    assert "SIMULATED" in result["simulated"]
    for row in result["batches"].values():
        assert row["adaptive"]["drafts_verified_per_request_step"] == 5
        assert row["adaptive_gain"] == 0


def test_steep_cost_verifies_fewer_and_gains(tmp_path):
    result = run(tmp_path, {1: 1.0, 16: 1.5, 256: 40.0})
    for row in result["batches"].values():
        assert row["adaptive"]["drafts_verified_per_request_step"] < 5
        assert row["adaptive_gain"] > 0
        assert row["fixed"]["drafts_verified_per_request_step"] == 5
