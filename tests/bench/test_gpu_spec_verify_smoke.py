"""Smoke test of bench/gpu_spec_verify.py --tiny on the CPU: plain, fixed-5 and adaptive verification of a tiny
DeepSeek-V4.1 through the engine with profile drafts. The report has the three modes at each batch and says the
acceptance is simulated; fixed verifies all 5 drafts wherever the request has room for them; coupled acceptance
gives plain decoding's tokens in both verify modes; some drafts are accepted. And where the continuation the drafts
come from goes wrong, it is generated again from the actual output. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_spec_verify.py"
# one intra-op thread: a tiny model on a shared 2-core machine (as the other bench smoke tests)
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def _run(tmp_path, *args: str) -> dict:
    """Run the benchmark --tiny on the CPU with `args` -> its report (written to tmp_path/spec.json)."""
    out = tmp_path / "spec.json"
    command = [sys.executable, str(SCRIPT), "--tiny", "--accelerator", "cpu", *args, "--out", str(out)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, env=ENV)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


def test_gpu_spec_verify_tiny_writes_a_complete_report(tmp_path):
    report = _run(tmp_path, "--batches", "2,3", "--max-tokens", "14", "--commit", "abc1234")
    assert "SIMULATED" in report["simulated"] and "SIMULATED" in report["method"]
    assert report["commit"] == "abc1234" and report["machine"]["cpu_count"]
    if report["plot"]["written"]:
        assert (tmp_path / "spec.png").stat().st_size > 0
    else:
        assert "matplotlib" in report["plot"]["reason"]
    assert report["step_costs"]["profiled"] is False or report["step_costs"]["ms"]
    assert set(report["batches"]) == {"2", "3"}
    for row in report["batches"].values():
        assert {"plain", "fixed", "adaptive", "adaptive_vs_fixed"} <= set(row)
        assert row["plain"]["tokens_per_s"] > 0 and row["plain"]["drafts_verified_per_request_step"] == 0
        fixed = row["fixed"]
        assert fixed["drafts_verified_with_room_for_all"] == 5
        assert fixed["drafts_verified_per_request_step"] == fixed["drafts_offered_per_request_step"]
        assert fixed["spec_stats"]["num_accepted_tokens"] > 0 and fixed["spec_stats"]["mean_accepted_length"] > 1
        for mode in ("fixed", "adaptive"):  # what adaptive admits follows the CPU's measured step costs: any amount
            result = row[mode]
            assert result["tokens_per_s"] > 0
            assert result["plain_match_fraction"] == 1.0  # coupled acceptance: plain decoding's tokens
            assert result["oracle_refreshes"] == 0 and result["fidelity"] in (1.0, None)  # verify = decode on CPU
            assert result["spec_stats"]["num_accepted_tokens"] == result["intended_accepted"]
            assert result["drafts_verified_per_request_step"] <= result["drafts_offered_per_request_step"]


@pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py
def test_drafts_follow_the_actual_output_where_it_leaves_the_plain_run(monkeypatch):
    """A continuation that goes wrong (as a bf16 verify step's other pick of a near tie makes it on a GPU) is
    generated again from the request's actual output: drafts then hit again, and the output stays plain's."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import _gpu_v4 as models
    import gpu_spec_verify as bench
    import torch

    from deepinfer_core.backend.registry import discover
    from deepinfer_core.backend.resolve import resolve_backend
    from deepinfer_core.backend.selection import select_backend

    args = bench.parse_args(["--tiny", "--batches", "2", "--max-tokens", "14", "--oracle-horizon", "4"])
    family = models.FAMILIES["v41"]
    cfg = family.parse(models.V41_TINY)
    backend = resolve_backend(select_backend(discover(), "cpu"), dtype=torch.float32)
    weights = models.random_weights(family, cfg, backend.torch_device, torch.float32, 0)
    model, _ = models.build_ours(family, cfg, weights, backend)
    systems, oracle = bench.build_systems(model, backend, args, {})
    prompts = bench.make_prompts(2, args.prompt_len, cfg.vocab_size, 1)
    _, plain = bench.run(systems["plain"], prompts, args.max_tokens, backend.torch_device)
    wrong = {rid: t[:3] + [(x + 7) % cfg.vocab_size for x in t[3:]] for rid, t in plain.items()}
    draws = bench._draws(args, 2, 0, args.max_tokens)
    result = bench.run_speculative(systems["fixed"], oracle, prompts, wrong, draws, args.max_tokens, args,
                                   backend.torch_device)  # fmt: skip
    assert result["oracle_refreshes"] >= 2  # both requests left the wrong continuation
    assert result["plain_match"]["identical_token_fraction"] == 3 / 14  # the output is plain's: it left `wrong` at 3
    assert result["fidelity"] < 1  # drafts made from the wrong tokens before the refresh were rejected
    assert result["spec_stats"]["num_accepted_tokens"] > 0


def test_with_dspark_draft_layers_the_tokens_are_still_plain_decodings(tmp_path):
    """--drafter dspark: the speculative engines run DSpark layers every step (their drafts replaced by the profile
    drafts): coupled acceptance still gives plain decoding's tokens, and drafts are accepted."""
    report = _run(tmp_path, "--batches", "2", "--max-tokens", "10", "--drafter", "dspark")
    assert "DSpark" in report["drafter"] and report["build_seconds"]["drafter_s"] > 0
    assert report["model"]["config"]["num_nextn_predict_layers"] == 3
    assert all(report["spec_scheduling"][mode].startswith("asynchronous") for mode in ("fixed", "adaptive"))
    for mode in ("fixed", "adaptive"):
        result = report["batches"]["2"][mode]
        assert result["plain_match_fraction"] == 1.0 and result["spec_stats"]["num_accepted_tokens"] > 0
        # steps planned while the one before ran took the profile drafts on the device (DeviceDrafts)
        assert result["pipelined_request_steps"] > 0 and result["fidelity"] is None
    # those drafts are accepted as the host's would be: as many as by fixed-k scheduled synchronously, in the same run
    assert report["spec_scheduling"]["fixed_sync"] == "synchronous"
    row = report["batches"]["2"]
    fixed, fixed_sync = row["fixed"], row["fixed_sync"]
    assert fixed_sync["pipelined_request_steps"] == 0 and fixed_sync["fidelity"] == 1.0
    assert fixed_sync["plain_match_fraction"] == 1.0 and "fixed_async_vs_sync" in row
    assert fixed["spec_stats"]["num_accepted_tokens"] == fixed_sync["spec_stats"]["num_accepted_tokens"]
    sync = _run(tmp_path, "--batches", "2", "--max-tokens", "6", "--drafter", "dspark", "--spec-scheduling", "sync")
    assert set(sync["spec_scheduling"]) == {"fixed", "adaptive"}
    assert all(how == "synchronous" for how in sync["spec_scheduling"].values())
