"""Offline throughput on CPU: DeepInfer's engine (reference backend) vs Hugging Face `generate`, same weights.

One run, side by side (DESIGN.md §7):

1. a small random DeepSeek-V3 checkpoint (transformers' DeepseekV3ForCausalLM, seeded, saved with
   save_pretrained; or an existing one with --checkpoint);
2. one workload: B prompts of random token ids, N new tokens each, greedy, EOS ignored;
3. DeepInfer: `LLM(accelerator="cpu", dtype="float32").generate(all prompts)` (continuous batching);
   Hugging Face: `model.generate` in float32 with eager attention, batch B, left padding + attention mask
   (optionally also batch 1, prompt after prompt);
4. the greedy outputs are compared (fraction of prompts with identical generated tokens), so the speed
   comparison is between systems that computed the same thing;
5. a bound: bytes of weights (+ MLA latent KV) read per forward step over a measured CPU copy bandwidth,
   and flops over a measured matmul rate. Both are estimates and are labelled so in the JSON.

Run: python bench/offline_throughput.py --out bench/results/offline_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # run as a script: bench/ holds its helpers
from _common import bound, machine, measure_copy_bandwidth, measure_matmul_rate, model_bytes, versions  # noqa: E402
from _offline_report import add_comparisons, greedy_agreement, print_table, system_result  # noqa: E402
from _offline_systems import DeepInferSystem, HFSystem, load_hf, time_interleaved  # noqa: E402
from _offline_workload import CHECKPOINT_ORIGIN, describe_workload, make_checkpoint, make_prompts  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/offline_cpu.json"))
    parser.add_argument("--checkpoint", type=Path, help="reuse this DeepSeek-V3 checkpoint folder")
    parser.add_argument("--save-checkpoint", type=Path, help="write the random checkpoint here and keep it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--min-prompt-len", type=int, help="draw lengths in [min, prompt-len] (default: all equal)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per system, interleaved, fresh prompts each")
    parser.add_argument("--hf-batch1", action="store_true", help="also run Hugging Face at batch 1, sequentially")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads; 0 keeps torch's default (one per core). 1 by default for repeatable numbers "
        "on a shared machine, where more threads make every small op wait for a descheduled thread (bench/README.md)",
    )
    parser.add_argument("--bandwidth-mb", type=int, default=512, help="size of the tensor copied to measure bandwidth")
    parser.add_argument("--config", type=json.loads, default={}, help="JSON overrides of the model config")
    parser.add_argument("--no-token-ids", action="store_true", help="leave generated token ids out of the JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="deepinfer-bench-") as tmp:
        if args.checkpoint:
            checkpoint, origin = args.checkpoint, "given"
        else:
            checkpoint = args.save_checkpoint or Path(tmp) / "ckpt"
            make_checkpoint(checkpoint, args.config, args.seed)
            origin = CHECKPOINT_ORIGIN
        sizes = model_bytes(checkpoint)
        vocab = sizes["config"]["vocab_size"]
        min_len = args.min_prompt_len or args.prompt_len
        prompt_sets = [
            make_prompts(args.num_prompts, min_len, args.prompt_len, vocab, args.seed + 100 + r)
            for r in range(args.repeats)
        ]
        warmup = make_prompts(min(args.num_prompts, 4), min_len, args.prompt_len, vocab, args.seed + 99)
        workload = describe_workload(
            args.num_prompts, min_len, args.prompt_len, args.max_new_tokens, prompt_sets, args.seed
        )
        print(
            f"checkpoint: {checkpoint} ({sizes['total'] / 1e6:.2f} M params); workload {args.num_prompts} prompts x "
            f"{args.prompt_len} tokens -> {args.max_new_tokens} new, {args.repeats} repeats, "
            f"{torch.get_num_threads()} thread(s)",
            flush=True,
        )

        systems = [
            DeepInferSystem(
                checkpoint,
                block_size=args.block_size,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
            )
        ]
        if not args.skip_hf:
            model, load_s = load_hf(checkpoint)
            systems.append(HFSystem(model, load_s, args.num_prompts))
            if args.hf_batch1:
                systems.append(HFSystem(model, load_s, 1))
        seconds, tokens, extras = time_interleaved(systems, warmup, prompt_sets, args.max_new_tokens)
        infos = {s.name: s.info for s in systems}
        del systems

    results = [
        system_result(infos[name], times, tokens[name], extras[name], args.repeats) for name, times in seconds.items()
    ]
    copy = measure_copy_bandwidth(args.bandwidth_mb)
    matmul = measure_matmul_rate()
    bound_info = bound(sizes, copy, matmul, workload)
    add_comparisons(results, bound_info, hf_batched=None if args.skip_hf else results[1])
    agree = greedy_agreement(tokens)
    if not args.no_token_ids:
        for r in results:
            r["token_ids_first_repeat"] = tokens[r["system"]][: args.num_prompts]

    report = {
        "benchmark": "offline_throughput",
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "bench/offline_throughput.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {
            **machine(),
            "load_average_1_5_15_before": load_before,
            "load_average_1_5_15_after": os.getloadavg(),
        },
        "versions": versions(),
        "checkpoint": {"origin": origin, "path": str(args.checkpoint) if args.checkpoint else None, "seed": args.seed},
        "config": sizes["config"],
        "workload": workload,
        "results": results,
        "greedy_agreement": agree,
        "bound": bound_info,
        "measurements": {"copy_bandwidth": copy, "matmul": matmul, "threads": torch.get_num_threads()},
        "wall_seconds": time.perf_counter() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print_table(results, bound_info, agree)
    print(f"\nwrote {args.out} ({report['wall_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
