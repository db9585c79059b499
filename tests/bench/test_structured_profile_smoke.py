"""Smoke tests of bench/structured_step_profile.py and bench/grammar_fill_modes.py on the CPU: tiny runs write
complete reports. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def run(script: str, *args: str) -> None:
    done = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=600,
                          env=ENV)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def test_step_profile_reports_the_engines_functions_per_constraint(tmp_path):
    out = tmp_path / "profile.json"
    run("structured_step_profile.py", "--batch", "2", "--max-tokens", "3", "--out", str(out))
    report = json.loads(out.read_text())
    assert [r["constraint"] for r in report["rows"]] == ["unconstrained", "regex", "json"]
    for row in report["rows"]:
        watched = row["cprofile"]["cumulative_ms_per_step"]
        assert watched["engine.py:_finalize"]["calls"] >= 3 and row["cprofile"]["top_own_time_ms_per_step"]
        assert ("grammars.py:accept" in watched) == (row["constraint"] != "unconstrained")
        assert row["torch_profiler"]["wall_s"] > 0


def test_fill_modes_time_every_mode(tmp_path):
    out = tmp_path / "fill.json"
    run("grammar_fill_modes.py", "--batch", "4", "--steps", "2", "--out", str(out))
    report = json.loads(out.read_text())
    assert {(r["constraint"], r["matchers"]) for r in report["rows"]} == {
        (c, m) for c in ("regex", "json") for m in ("copies", "fresh")
    }
    for row in report["rows"]:
        assert {"per_row", "executor_1", "executor_12", "consume_per_row", "consume_executor_1"} <= set(row)
        assert all(row[k]["ms_median"] > 0 for k in ("per_row", "executor_1"))
