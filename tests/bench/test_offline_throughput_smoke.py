"""Smoke test of bench/offline_throughput.py on a tiny checkpoint: it runs and writes a complete report.

No timing is asserted (DESIGN.md §7): only that the script works end to end and the JSON has its fields.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "offline_throughput.py"
TINY = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
}


def test_offline_throughput_writes_a_complete_report(tmp_path):
    out = tmp_path / "report.json"
    args = ["--out", str(out), "--num-prompts", "3", "--prompt-len", "8", "--min-prompt-len", "5"]
    args += ["--max-new-tokens", "3", "--repeats", "1", "--hf-batch1", "--bandwidth-mb", "8"]
    args += ["--config", json.dumps(TINY)]
    run = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {"machine", "versions", "config", "workload", "results", "greedy_agreement", "bound"} <= set(report)
    assert report["versions"]["torch"] and report["versions"]["transformers"]
    systems = {r["system"]: r for r in report["results"]}
    assert set(systems) == {"deepinfer", "hf_batch3", "hf_batch1"}
    for result in systems.values():
        assert result["output_tokens"] == 3 * 3
        assert result["output_tokens_per_s"] > 0
    assert systems["deepinfer"]["prefix_cached_tokens"] == 0
    assert "deepinfer_vs_hf_batch3" in report["greedy_agreement"]
    assert report["bound"]["weight_bytes_per_step_estimate"] > 0
