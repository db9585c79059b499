"""DeepSeek-V4.1 on a GPU backend against the reference's recordings (tests/fixtures/deepseek_v41): a check to
run on the machine, not a unit test (CI has no GPU). For each case, in float32: ragged-prefill logits of the
recorded prompts in one forward (max |difference| per prompt, rows beyond the unit tests' tolerance), chunked
prefill and single-token decode likewise, and greedy tokens through the engine (chunked prefill, two
sequence slots); in bfloat16: greedy agreement with the reference's float32 tokens. Writes a JSON report.

Run (repository root): python tools/gpu_v41_parity.py --accelerator nvidia --out /tmp/v41_parity.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch

from deepinfer_core.backend.registry import discover
from deepinfer_core.backend.resolve import resolve_backend
from deepinfer_core.backend.selection import select_backend
from deepinfer_core.engine.llm import LLM
from deepinfer_core.sampling.params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def _parity_module():
    sys.path.insert(0, str(ROOT))  # it imports tests.model.step_runner
    path = ROOT / "tests/model/test_deepseek_v41_parity.py"
    spec = importlib.util.spec_from_file_location("v41_parity", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _compare(got: torch.Tensor, want: torch.Tensor, t) -> dict:
    got = got.float().cpu()
    off = [i for i in range(got.shape[0]) if not torch.allclose(got[i], want[i], atol=t.ATOL, rtol=t.RTOL)]
    return {
        "max_abs_diff": float((got - want).abs().max()),
        "rows_beyond_tolerance": off,
        "top_tokens_agree": bool(torch.equal(got.argmax(-1), want.argmax(-1))),
    }


def check(case: str, accelerator: str, t) -> dict:
    meta, want = t._case(case)
    report: dict = {"case": case}
    backend = resolve_backend(select_backend(discover(), accelerator), dtype=torch.float32, block_size=t.BLOCK)
    model = t._model(case, backend)
    prompts = meta["prefill"]["prompts"]
    requests = t._requests(prompts, seed=5)
    got = t._step_logits(model, t._runner(model, backend), [(r, len(r.prompt_token_ids)) for r in requests])
    report["prefill"] = [_compare(g, want[n], t) for g, n in zip(got, meta["prefill"]["logits"])]
    runner = t._runner(model, backend)
    [request] = t._requests([prompts[meta["chunked"]["prompt_index"]]], seed=6)
    chunks = [t._step_logits(model, runner, [(request, n)])[0] for n in meta["chunked"]["chunk_sizes"]]
    report["chunked"] = _compare(torch.cat(chunks), want[meta["chunked"]["logits"]], t)
    decode = meta["decode"]
    runner = t._runner(model, backend)
    [request] = t._requests([decode["prompt"] + decode["fed_tokens"]], seed=7)
    t._step_logits(model, runner, [(request, len(decode["prompt"]))])
    steps = [t._step_logits(model, runner, [(request, 1)])[0] for _ in decode["fed_tokens"]]
    report["decode"] = _compare(torch.cat(steps), want[decode["logits"]], t)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for dtype in ("float32", "bfloat16"):
        llm = LLM(
            model=str(t.FIXTURES / case),
            accelerator=accelerator,
            dtype=dtype,
            block_size=t.BLOCK,
            num_kv_blocks=t.NUM_BLOCKS,
            max_num_batched_tokens=8,
            max_num_seqs=2,
            progress=False,
        )
        outputs = llm.generate(prompts, params)
        agree = []
        for i, name in enumerate(meta["greedy"]["token_ids"]):
            mine, theirs = list(outputs[i].outputs[0].token_ids), want[name].tolist()
            agree.append(next((j for j, (a, b) in enumerate(zip(mine, theirs)) if a != b), len(theirs)))
        report[f"greedy_{dtype}"] = {"tokens_agreeing_before_first_difference": agree, "of": 16}
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="nvidia")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    t = _parity_module()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    cases = [check(case, args.accelerator, t) for case in t.CASES]
    float32_ok = all(
        all(p["top_tokens_agree"] and len(p["rows_beyond_tolerance"]) <= 8 for p in c["prefill"])
        and c["greedy_float32"]["tokens_agreeing_before_first_difference"] == [16] * len(c["prefill"])
        for c in cases
    )
    report = {
        "machine": device,
        "accelerator": args.accelerator,
        "commit": commit or None,
        "torch": torch.__version__,
        "float32_matches_reference": float32_ok,
        "cases": cases,
    }
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0 if float32_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
