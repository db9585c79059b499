"""Smoke test of bench/structured_overhead.py on the CPU: a tiny run writes a report with, per batch and
constraint, the unconstrained and constrained throughput and the engine's mask times. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "structured_overhead.py"


def test_tiny_run_writes_a_complete_report(tmp_path):
    out = tmp_path / "overhead.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    args = [sys.executable, str(SCRIPT), "--batches", "2", "--max-tokens", "4", "--repeats", "1", "--out", str(out)]
    run = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["backend"] == "cpu" and report["machine"]["cpu_count"]
    assert {(r["batch"], r["constraint"]) for r in report["rows"]} == {(2, "regex"), (2, "json")}
    for row in report["rows"]:
        assert row["unconstrained"]["tokens"] == row["constrained"]["tokens"] == 8  # ignore_eos: all max_tokens
        assert row["constrained"]["mask_samples"] >= 8 and row["constrained"]["mask_us_median"] > 0
