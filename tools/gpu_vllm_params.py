"""The vLLM-style request features (n, best_of, min_tokens, prompt_logprobs, ranked logprobs, engine seed)
on a GPU backend against the reference `cpu` backend, on the tiny V3 checkpoint in float32.

    python tools/gpu_vllm_params.py --accelerator nvidia --out result.json

Greedy tokens must be equal and logprobs close (float32); seeded samples are compared as token lists
(the same noise on equal logits gives the same tokens). Writes JSON naming the machine and the commit.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

from deepinfer import LLM, SamplingParams
from deepinfer_conformance.tiny_v3 import write_tiny_v3

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19]
CASES = {
    "greedy_ranked_logprobs": SamplingParams(temperature=0, max_tokens=12, logprobs=5, ignore_eos=True),
    "n3_seeded": SamplingParams(temperature=0.9, n=3, seed=7, max_tokens=12, ignore_eos=True),
    "best_of4_n2": SamplingParams(temperature=0.9, n=2, best_of=4, seed=3, max_tokens=10, ignore_eos=True),
    "min_tokens_stop_token": SamplingParams(temperature=0, max_tokens=12, min_tokens=6, logprobs=1),
    "prompt_logprobs": SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, ignore_eos=True),
}


def run(llm: LLM) -> dict:
    out = {}
    for name, params in CASES.items():
        [result] = llm.generate([PROMPT], params, use_tqdm=False)
        samples = [
            {
                "token_ids": list(s.token_ids),
                "token_logprobs": list(s.token_logprobs) if s.token_logprobs else None,
                "ranks": [s.logprobs[i][t].rank for i, t in enumerate(s.token_ids)] if s.logprobs else None,
            }
            for s in result.outputs
        ]
        prompt = None
        if result.prompt_logprobs is not None:
            prompt = [None] + [e[t].logprob for e, t in zip(result.prompt_logprobs[1:], PROMPT[1:])]
        out[name] = {"samples": samples, "prompt_logprobs": prompt}
    return out


def compare(gpu: dict, cpu: dict) -> dict:
    verdict = {}
    for name in CASES:
        g, c = gpu[name], cpu[name]
        tokens_equal = [s["token_ids"] for s in g["samples"]] == [s["token_ids"] for s in c["samples"]]
        worst = 0.0
        for gs, cs in zip(g["samples"], c["samples"]):
            if gs["token_logprobs"] and cs["token_logprobs"]:
                worst = max(worst, max(abs(a - b) for a, b in zip(gs["token_logprobs"], cs["token_logprobs"])))
        if g["prompt_logprobs"]:
            worst = max(worst, max(abs(a - b) for a, b in zip(g["prompt_logprobs"][1:], c["prompt_logprobs"][1:])))
        verdict[name] = {"tokens_equal": tokens_equal, "max_abs_logprob_err": worst}
    return verdict


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="nvidia")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = write_tiny_v3(Path(folder) / "tiny-v3")
        results = {}
        for accelerator in (args.accelerator, "cpu"):
            llm = LLM(model=path, accelerator=accelerator, dtype="float32", block_size=None, progress=False)
            results[accelerator] = run(llm)
            del llm
    verdict = compare(results[args.accelerator], results["cpu"])
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {
        "machine": {
            "host": platform.node(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__,
        },
        "commit": commit or None,
        "accelerator": args.accelerator,
        "verdict": verdict,
        "results": results,
    }
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(verdict, indent=1))
    return 0 if all(v["tokens_equal"] for v in verdict.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
