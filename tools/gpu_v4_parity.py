"""DeepSeek-V4 on a GPU backend against transformers on the same GPU: a check to run on the machine, not a
unit test (CI has no GPU). For each tiny checkpoint of tests/model/hf_v4_checkpoints.py: greedy tokens and
chosen-token logprobs of a ragged batch in float32 (chunked prefill, two sequence slots, then a prefix
hit with bounded replay), compared with transformers' float32 forward; in bfloat16 the top-1 agreement
with transformers' float32 argmax. Writes a JSON report.

Run (repository root): python tools/gpu_v4_parity.py --accelerator nvidia --out /tmp/v4_parity.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch

from deepinfer_core.engine.llm import LLM
from deepinfer_core.sampling.params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def _checkpoints():
    spec = importlib.util.spec_from_file_location("hf_v4_checkpoints", ROOT / "tests/model/hf_v4_checkpoints.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@torch.no_grad()
def _hf_logprobs(hf_model, prompt: list[int], generated, device) -> torch.Tensor:
    ids = torch.tensor([prompt + list(generated)], device=device)
    return hf_model(ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(dim=-1).cpu()


def check(variant: str, helper, root: Path, accelerator: str, device: str) -> dict:
    ckpt = helper.build_v4_checkpoint(variant, root)
    hf = ckpt.hf_model.to(device)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 256, (n,), generator=g).tolist() for n in (3, 20, 45, 70, 100)]
    prompts.append(prompts[-1][:96] + [7])  # a prefix hit on the 100-token prompt's 6 blocks
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    report = {"variant": variant}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(
            model=ckpt.path,
            accelerator=accelerator,
            dtype=dtype,
            block_size=16,
            num_kv_blocks=128,
            max_num_batched_tokens=24,
            max_num_seqs=2,
            progress=False,
        )
        outputs = llm.generate(prompts[:-1], params) + llm.generate(prompts[-1:], params)
        rows = []
        for prompt, output in zip(prompts, outputs):
            got = output.outputs[0]
            theirs = _hf_logprobs(hf, prompt, got.token_ids, device)
            chosen = theirs.gather(1, torch.tensor(got.token_ids)[:, None])[:, 0]
            rows.append(
                {
                    "prompt_len": len(prompt),
                    "cached_tokens": output.num_cached_tokens,
                    "top1_agree": float((theirs.argmax(dim=-1) == torch.tensor(got.token_ids)).float().mean()),
                    "max_abs_logprob_err": float((torch.tensor(got.token_logprobs) - chosen).abs().max()),
                }
            )
        report[dtype] = {"backend": llm.backend.info.name, "device": llm.backend.device.name, "prompts": rows}
    f32 = report["float32"]["prompts"]
    report["float32_ok"] = all(r["top1_agree"] == 1.0 and r["max_abs_logprob_err"] < 1e-3 for r in f32)
    report["prefix_hit_seen"] = f32[-1]["cached_tokens"] == 96
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="nvidia")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    helper = _checkpoints()
    with tempfile.TemporaryDirectory() as tmp:
        reports = [check(v, helper, Path(tmp), args.accelerator, device) for v in ("a", "b")]
    args.out.write_text(json.dumps({"torch": torch.__version__, "hf_device": device, "checks": reports}, indent=2))
    ok = all(r["float32_ok"] and r["prefix_hit_seen"] for r in reports)
    for r in reports:
        print(
            r["variant"], "float32 ok" if r["float32_ok"] else "float32 MISMATCH", json.dumps(r["bfloat16"]["prompts"])
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
