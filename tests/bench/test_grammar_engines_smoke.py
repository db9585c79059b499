"""Smoke test of bench/grammar_engines.py: it walks each constrained text through llguidance (a dependency, so
always present) on the demo tokenizer and reports compile and mask times; xgrammar is reported absent or measured
the same way. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "grammar_engines.py"


def test_run_writes_a_report_with_every_case(tmp_path):
    out = tmp_path / "grammars.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    llg = report["engines"]["llguidance"]
    assert llg["requires"] == [] and llg["installed_bytes"] > 0
    assert set(llg["cases"]) == {"json_schema", "regex", "choice"}
    for case in llg["cases"].values():
        assert case["tokens"] > 0 and case["median_us"] > 0 and case["compile_ms"] > 0
    xgr = report["engines"]["xgrammar"]
    assert xgr.get("available") is False or set(xgr["cases"]) == set(llg["cases"])
