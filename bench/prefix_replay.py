"""Prefill of a long prompt whose prefix is cached: DeepSeek-V4's bounded replay vs recomputing it all.

DeepSeek-V4 keeps no per-block copy of its sliding windows and compressor state: on a prefix-cache hit
the engine reuses the compressed KV blocks and recomputes only the last `replay_tokens` = layers x
(window - 1) tokens before the hit's end to rebuild the windows (DESIGN: "SWA bounded replay"). One run,
side by side, same weights, same prompts:

- `full_recompute`: prefix caching off, the whole prompt is prefilled;
- `bounded_replay`: the prefix was cached by an earlier request; the replay plus the new suffix are
  prefilled;
- `floor_no_replay`: the same hit with the replay switched off. Its output is WRONG (the windows are
  stale); it is the floor that storing every window per block would reach, for timing only.

For each: prefill tokens actually computed (from the scheduler), median / best seconds over rounds (a
fresh suffix each round, so the hit is always exactly the shared prefix), and the first token's logprob,
which must agree between full_recompute and bounded_replay. The report also gives the token saving the
same prompt would see on V4 Flash's 43 layers and 128-token window.

Run: python bench/prefix_replay.py --out bench/results/prefix_replay_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))  # run as a script: bench/ holds its helpers
from _common import machine, median, versions  # noqa: E402

from deepinfer_core.engine.llm import LLM  # noqa: E402
from deepinfer_core.model.config_v4 import CSA, HCA, SLIDING, DeepseekV4Config  # noqa: E402
from deepinfer_core.model.demo import demo_weights  # noqa: E402
from deepinfer_core.sampling.params import SamplingParams  # noqa: E402

CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "vocab_size": 4096,
    "hidden_size": 256,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 8,
    "layer_types": [SLIDING, CSA, HCA, CSA, SLIDING, CSA, HCA, CSA],
    "mlp_layer_types": ["hash_moe"] * 3 + ["moe"] * 5,
    "compress_rates": {CSA: 4, HCA: 128},
    "sliding_window": 128,
    "num_attention_heads": 4,
    "head_dim": 128,
    "partial_rotary_factor": 0.125,
    "q_lora_rank": 128,
    "o_groups": 2,
    "o_lora_rank": 64,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 512,
    "hc_mult": 4,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "max_position_embeddings": 65536,
    "eos_token_id": 1,
}
V4_FLASH = {"num_hidden_layers": 43, "sliding_window": 128}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON report path")
    parser.add_argument("--prompt-len", type=int, default=4096, help="tokens in the measured prompt")
    parser.add_argument("--suffix-len", type=int, default=128, help="its tokens past the cached prefix")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per system")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--config", default="{}", help="JSON overrides of the model config")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--accelerator", default="cpu", help="backend to run on (default: the cpu reference)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    return parser


def make_checkpoint(raw: dict, folder: Path) -> Path:
    weights = demo_weights(DeepseekV4Config.from_hf(raw), seed=7)
    save_file({name: t.contiguous() for name, t in weights.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def run_system(
    name: str, llm: LLM, prefix: list[int], suffixes: list[list[int]], warm: list[int] | None, warm_up: list[int]
) -> dict:
    """Time the prefill (one sampled token) of prefix + each suffix; `warm` first caches the prefix.
    `warm_up` runs once untimed first."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=0)
    llm.generate([warm_up], params)  # compiles and caches kernels; its tokens share nothing with the prompts
    scheduler = llm.engine.scheduler
    schedule, steps = scheduler.schedule, []
    scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]  # records every step
    seconds, computed, cached, first = [], [], [], []
    for suffix in suffixes:
        if warm is not None:
            llm.generate([prefix + warm], params)  # puts the prefix in the cache (untimed)
        steps.clear()
        start = time.perf_counter()
        output = llm.generate([prefix + suffix], params)[0]
        seconds.append(time.perf_counter() - start)
        computed.append(sum(step.num_tokens for step in steps))
        cached.append(output.num_cached_tokens)
        first.append((output.outputs[0].token_ids[0], output.outputs[0].token_logprobs[0]))
    return {
        "system": name,
        "seconds": seconds,
        "median_seconds": median(seconds),
        "best_seconds": min(seconds),
        "prefill_tokens_computed": computed,
        "cached_tokens": cached,
        "first_token_and_logprob": first,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    raw = {**CONFIG, **json.loads(args.config)}
    config = DeepseekV4Config.from_hf(raw)
    block = 128 if max(config.compress_rates.values()) > 64 else 64
    generator = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(2, config.vocab_size, (n,), generator=generator).tolist()

    prefix = tokens(args.prompt_len - args.suffix_len)
    suffixes = [tokens(args.suffix_len) for _ in range(args.repeats)]
    warm = tokens(args.suffix_len)
    warm_up = tokens(min(args.prompt_len, 1024))
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(raw, Path(tmp))

        def llm(**kwargs) -> LLM:
            kwargs.setdefault("max_num_batched_tokens", args.max_num_batched_tokens)
            return LLM(
                model=path,
                accelerator=args.accelerator,
                dtype=args.dtype,
                block_size=block,
                progress=False,
                num_kv_blocks=4 * (args.prompt_len // block + 2),
                **kwargs,
            )

        full_llm = llm(enable_prefix_caching=False)
        results_backend = full_llm.backend.info.name
        device = full_llm.backend.device.name
        results = [run_system("full_recompute", full_llm, prefix, suffixes, None, warm_up)]
        results.append(run_system("bounded_replay", llm(), prefix, suffixes, warm, warm_up))
        floor = llm()
        floor.engine.blocks.replay_tokens = 0  # wrong output: the timing floor of stored windows
        results.append(run_system("floor_no_replay", floor, prefix, suffixes, warm, warm_up))
        # the same full prefill in other chunks: how far rounding alone moves the first logprob
        other = llm(enable_prefix_caching=False, max_num_batched_tokens=max(block, args.max_num_batched_tokens // 2))
        results.append(run_system("full_recompute_other_chunks", other, prefix, suffixes, None, warm_up))
    full, replay = results[0], results[1]
    firsts = {r["system"]: r["first_token_and_logprob"] for r in results}

    def gaps(name: str) -> list[float]:
        return [abs(a[1] - b[1]) for a, b in zip(firsts["full_recompute"], firsts[name])]

    noise = gaps("full_recompute_other_chunks")
    # exact in real arithmetic; allowed: the dtype's tolerance, or twice the largest move re-chunking alone
    # made (on deep random models rounding differences grow layer by layer)
    allowed = max(1e-4 if args.dtype == "float32" else 5e-2, 2 * max(noise))
    agree = [
        a[0] == b[0] and gap <= allowed
        for a, b, gap in zip(full["first_token_and_logprob"], replay["first_token_and_logprob"], gaps("bounded_replay"))
    ]
    flash = DeepseekV4Config.from_hf({**raw, **V4_FLASH, "layer_types": None, "mlp_layer_types": None})
    report = {
        "benchmark": "prefix_replay",
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "machine": machine(),
        "versions": versions(),
        "backend": results_backend,
        "device": device,
        "dtype": args.dtype,
        "config": raw,
        "workload": {
            "prompt_len": args.prompt_len,
            "suffix_len": args.suffix_len,
            "repeats": args.repeats,
            "block_size": block,
        },
        "replay_tokens": config.replay_tokens,
        "results": results,
        "first_token_agrees_full_vs_replay": agree,
        "first_logprob_gap_vs_full": {
            "bounded_replay": gaps("bounded_replay"),
            "floor_no_replay": gaps("floor_no_replay"),
            "full_recompute_other_chunks (rounding noise)": noise,
        },
        "prefill_tokens_saved_fraction": 1
        - median(replay["prefill_tokens_computed"]) / median(full["prefill_tokens_computed"]),
        "time_saved_fraction": 1 - replay["median_seconds"] / full["median_seconds"],
        "v4_flash_estimate": {
            "replay_tokens": flash.replay_tokens,
            "prefill_tokens_saved_fraction_by_prompt_len": {
                n: max(0, n - args.suffix_len - flash.replay_tokens) / n
                for n in (args.prompt_len, 8192, 11264, 32768, 131072)
            },
            "note": "43 layers x (128 - 1) replayed tokens, a hit on all but the last suffix_len tokens; a count, "
            "not a measured time",
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'system':18} {'median s':>9} {'best s':>9} {'tokens':>8} {'cached':>7}")
    for r in results:
        tokens, hit = median(r["prefill_tokens_computed"]), r["cached_tokens"][0]
        print(f"{r['system']:18} {r['median_seconds']:9.3f} {r['best_seconds']:9.3f} {tokens:8.0f} {hit:7d}")
    print(
        f"replay {config.replay_tokens} tokens; saved {report['prefill_tokens_saved_fraction']:.1%} of prefill tokens, "
        f"{report['time_saved_fraction']:.1%} of time; first token agrees: {all(agree)}"
    )
    return 0 if all(agree) else 1


if __name__ == "__main__":
    sys.exit(main())
