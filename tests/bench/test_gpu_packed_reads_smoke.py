"""Smoke test of bench/gpu_packed_reads.py --tiny on the CPU (Triton's interpreter): it runs, writes a report naming
the machine, the systems and each case's bound, and its packed systems compute the same bits staged or not. No
timing is asserted (DESIGN.md §7)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (tox installs it for the kernel tests)")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_packed_reads.py"


def test_tiny_run_writes_a_complete_report(tmp_path):
    out = tmp_path / "packed.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    args = ["--tiny", "--decode", "1@18", "--prefill", "1@6", "--out", str(out)]
    run = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["machine"]["cpu_count"] and report["versions"]["torch"]
    assert set(report["systems"]) == {"plain", "staged", "in_kernel", "auto"}
    assert [(r["kind"], r["batch"], r["context"], r["queries_per_sequence"]) for r in report["rows"]] == [
        ("decode", 1, 18, 1),
        ("prefill", 1, 0, 6),
    ]
    for row in report["rows"]:
        assert all(row[f"{system}_ms"] > 0 for system in report["systems"])
        assert 0 < row["packed_bytes"] < row["plain_bytes"] and row["packed_bound_ms"] < row["plain_bound_ms"]
        assert row["staged_equals_in_kernel"] and row["auto_equals_staged"]
