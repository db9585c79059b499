"""Smoke test of bench/prefix_replay.py on a tiny DeepSeek-V4: it runs and writes a complete report, the
exactly replayed prefill computes fewer tokens than the full one and gives the same first token, and the
bounded one computes at most 128 replayed tokens.

No timing is asserted (DESIGN.md §7).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "prefix_replay.py"
TINY = {
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    "mlp_layer_types": ["hash_moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "sliding_window": 16,
    "head_dim": 32,
    "q_lora_rank": 32,
    "hc_mult": 2,
    "index_topk": 16,
}


def test_prefix_replay_writes_a_complete_report(tmp_path):
    out = tmp_path / "report.json"
    args = ["--out", str(out), "--prompt-len", "320", "--suffix-len", "24", "--repeats", "1"]
    run = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--config", json.dumps(TINY)], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    keys = {"machine", "versions", "config", "workload", "results", "replay_tokens", "bounded_drift_vs_exact"}
    assert keys | {"flash_estimate"} <= set(report)
    systems = {r["system"]: r for r in report["results"]}
    assert set(systems) == {
        "full_recompute",
        "full_recompute_every_layer",
        "exact_replay",
        "bounded_replay",
        "snapshot_restore",
        "floor_no_replay",
        "full_recompute_other_chunks",
    }
    assert report["replay_tokens"] == 3 * 15
    assert systems["full_recompute"]["prefill_tokens_computed"] == [320]
    hit = systems["exact_replay"]["cached_tokens"][0]
    assert hit == 256  # the 296 shared tokens hold 4 full 64-token blocks
    assert systems["exact_replay"]["prefill_tokens_computed"] == [320 - hit + 45]
    assert systems["bounded_replay"]["prefill_tokens_computed"] == [320 - hit + 45]  # 45 < 128: the same replay
    assert systems["floor_no_replay"]["prefill_tokens_computed"] == [320 - hit]
    # the earlier 296-token prompt stopped at its last block boundary (256) and left a snapshot there
    assert systems["snapshot_restore"]["cached_tokens"] == [hit]
    assert systems["snapshot_restore"]["prefill_tokens_computed"] == [320 - hit]
    assert report["first_token_agrees_full_vs_exact_replay_and_snapshot_restore"] == [True, True]
    assert report["bounded_drift_vs_exact"]["first_token_past_the_hit"]["greedy_agrees"] is True
    assert report["flash_estimate"]["exact_replay_tokens"] == 43 * 127
    assert report["ced_prefill"]["rows_computed_fraction"] is None  # V4: every layer writes paged caches


def test_prefix_replay_runs_deepseek_v41_and_bounds_its_replay(tmp_path):
    out = tmp_path / "report.json"
    args = ["--out", str(out), "--model", "v41", "--prompt-len", "320", "--suffix-len", "24", "--repeats", "1"]
    tiny = {"num_hidden_layers": 10, "sliding_window": 16, "hidden_size": 64, "hc_mult": 2, "vocab_size": 512}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--config", json.dumps(tiny)], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    systems = {r["system"]: r for r in report["results"]}
    assert report["replay_tokens"] == 10 * 15 and report["bounded_replay_tokens"] == 128
    hit = systems["exact_replay"]["cached_tokens"][0]
    assert hit == 256  # V4.1 runs with DeepSeek's 128-token blocks
    assert systems["exact_replay"]["prefill_tokens_computed"] == [320 - hit + 150]
    assert systems["bounded_replay"]["prefill_tokens_computed"] == [320 - hit + 128]
    assert systems["snapshot_restore"]["prefill_tokens_computed"] == [320 - hit]  # restored, nothing replayed
    assert report["first_token_agrees_full_vs_exact_replay_and_snapshot_restore"] == [True, True]
    assert set(report["bounded_drift_vs_exact"]["first_token_past_the_hit"]) == {
        "max_abs_logprob_diff",
        "kl_divergence",
        "greedy_agrees",
    }
    assert report["flash_estimate"]["exact_replay_tokens"] == 40 * 127
    ced = report["ced_prefill"]
    assert 0 < ced["rows_computed_fraction"] < 1
    # V4.1 Flash's schedule (sources up to layer 20, 128-token window), 8192 tokens: layers 0-20 all of them,
    # layer 21 the last 2414 and 127 fewer each layer after: 196,181 of 40 x 8192 rows
    assert ced["rows_computed_fraction_at_flash_depth"]["8192"] == pytest.approx(196181 / (40 * 8192))
