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
from _common import bound, machine, measure_copy_bandwidth, measure_matmul_rate, median, model_bytes, versions  # noqa: E402

# ---- checkpoint -----------------------------------------------------------------------------------

DEFAULT_CONFIG = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "qk_rope_head_dim": 32,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def make_checkpoint(path: Path, config_overrides: dict, seed: int) -> dict:
    """Random DeepseekV3ForCausalLM (seeded) saved to `path`; e_score_correction_bias set non-zero."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(**{**DEFAULT_CONFIG, **config_overrides})
    model = DeepseekV3ForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buffer in list(model.named_buffers()) + list(model.named_parameters()):
            if name.endswith("e_score_correction_bias"):
                # transformers leaves it at zero; non-zero changes routing, so the benchmark covers it
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.05)
    model.save_pretrained(path)
    return {**DEFAULT_CONFIG, **config_overrides}


# ---- workload -------------------------------------------------------------------------------------


def make_prompts(count: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    """Random token ids, avoiding the first 8 ids (BOS/EOS/pad in most configs)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=generator).tolist()
    return [torch.randint(8, vocab, (n,), generator=generator).tolist() for n in lengths]


# ---- systems --------------------------------------------------------------------------------------


class DeepInferSystem:
    """DeepInfer's offline API on the reference backend: every prompt in one `generate` call."""

    name = "deepinfer"

    def __init__(self, checkpoint: Path, args) -> None:
        from deepinfer_core.engine.llm import LLM

        t0 = time.perf_counter()
        self.llm = LLM(
            model=checkpoint,
            accelerator="cpu",
            dtype="float32",
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            progress=False,
        )
        self.load_seconds = time.perf_counter() - t0
        self.info = {
            "system": self.name,
            "description": (
                "DeepInfer LLM.generate, reference backend (accelerator=cpu), float32, all prompts in one call"
            ),
            "backend": self.llm.backend.info.name,
            "block_size": self.llm.backend.kv_layout.block_size,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "prefix_caching": "on (engine default); every repeat uses fresh prompts, so no hits are expected",
            "load_seconds": self.load_seconds,
        }

    def generate(self, prompts, max_tokens: int) -> tuple[list[list[int]], dict]:
        from deepinfer_core.sampling.params import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        steps_before = getattr(self.llm.engine, "_step", None)  # a private counter; None if it goes away
        outputs = self.llm.generate(prompts, params)
        steps_after = getattr(self.llm.engine, "_step", None)
        extra = {
            "engine_steps": None if steps_before is None else steps_after - steps_before,
            "prefix_cached_tokens": sum(o.num_cached_tokens for o in outputs),
            "finish_reasons": sorted({o.outputs[0].finish_reason for o in outputs}),
        }
        return [list(o.outputs[0].token_ids) for o in outputs], extra


class HFSystem:
    """transformers' DeepseekV3ForCausalLM.generate, batched the way a user would (left padding + mask)."""

    def __init__(self, model, load_seconds: float, batch_size: int) -> None:
        self.model, self.batch_size, self.name = model, batch_size, f"hf_batch{batch_size}"
        self.info = {
            "system": self.name,
            "description": (
                f"transformers DeepseekV3ForCausalLM.generate, float32, eager attention, batch {batch_size}, "
                "left padding + attention_mask, do_sample=False, min_new_tokens=max_new_tokens, eos_token_id=None"
            ),
            "batch_size": batch_size,
            "load_seconds": load_seconds,
        }

    def _batch(self, prompts, max_new_tokens: int, pad_id: int = 0) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                # no EOS: decoding never stops early and no EOS logit gets masked, i.e. DeepInfer's ignore_eos
                eos_token_id=None,
                pad_token_id=pad_id,
                use_cache=True,
            )
        return [row[width:].tolist() for row in out]

    def generate(self, prompts, max_tokens: int) -> tuple[list[list[int]], dict]:
        tokens: list[list[int]] = []
        for start in range(0, len(prompts), self.batch_size):
            tokens += self._batch(prompts[start : start + self.batch_size], max_tokens)
        return tokens, {"forward_steps": max_tokens * -(-len(prompts) // self.batch_size)}


def load_hf(checkpoint: Path):
    from transformers import DeepseekV3ForCausalLM

    t0 = time.perf_counter()
    model = DeepseekV3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager").eval()
    return model, time.perf_counter() - t0


# ---- agreement ------------------------------------------------------------------------------------


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = [x == y for x, y in zip(a, b)]

    def first_diff(x, y):
        return next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))

    token_matches = sum(p == q for x, y in zip(a, b) for p, q in zip(x, y))
    total = sum(max(len(x), len(y)) for x, y in zip(a, b))
    return {
        "identical_prompt_fraction": sum(same) / len(same),
        "identical_prompts": sum(same),
        "prompts": len(same),
        "position_match_fraction": token_matches / total if total else 1.0,
        "first_divergence_index": [None if s else first_diff(x, y) for s, x, y in zip(same, a, b)],
    }


# ---- report ---------------------------------------------------------------------------------------


def print_table(results: list[dict], bound_info: dict, agree: dict) -> None:
    lower = bound_info["lower_bound_seconds_estimate"]
    print()
    print(f"{'system':<14} {'median s':>9} {'best s':>8} {'out tok/s':>10} {'steps':>6} {'x bound':>8} {'vs HF':>6}")
    for r in results:
        steps = r.get("engine_steps", r.get("forward_steps"))
        speedup = r.get("speedup_vs_hf_batched")
        print(
            f"{r['system']:<14} {r['median_seconds']:>9.3f} {r['best_seconds']:>8.3f} "
            f"{r['output_tokens_per_s']:>10.1f} {steps if steps is not None else '-':>6} "
            f"{r['median_seconds'] / lower:>8.1f} {f'{speedup:.2f}x' if speedup else '-':>6}"
        )
    print(
        f"{'bound (est.)':<14} {lower:>9.3f} {'':>8} {bound_info['bound_output_tokens_per_s_estimate']:>10.1f} "
        f"{bound_info['min_forward_steps']:>6}   (memory {bound_info['memory_bound_seconds_estimate']:.3f} s, "
        f"compute {bound_info['compute_bound_seconds_estimate']:.3f} s)"
    )
    for pair, a in agree.items():
        print(
            f"greedy agreement {pair}: {a['identical_prompts']}/{a['prompts']} prompts identical, "
            f"{a['position_match_fraction']:.3f} of positions"
        )


def main(argv: list[str] | None = None) -> int:
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
    args = parser.parse_args(argv)

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
            origin = "random, transformers DeepseekV3ForCausalLM(config) seeded, e_score_correction_bias ~ N(0, 0.05)"
        sizes = model_bytes(checkpoint)
        vocab = sizes["config"]["vocab_size"]
        min_len = args.min_prompt_len or args.prompt_len
        prompt_sets = [
            make_prompts(args.num_prompts, min_len, args.prompt_len, vocab, args.seed + 100 + r)
            for r in range(args.repeats)
        ]
        warmup = make_prompts(min(args.num_prompts, 4), min_len, args.prompt_len, vocab, args.seed + 99)
        workload = {
            "num_prompts": args.num_prompts,
            "prompt_len_range": [min_len, args.prompt_len],
            "mean_prompt_len": sum(len(p) for ps in prompt_sets for p in ps) / (args.num_prompts * args.repeats),
            "max_new_tokens": args.max_new_tokens,
            "greedy": True,
            "ignore_eos": True,
            "prompt_tokens": "uniform random ids in [8, vocab); a fresh set per repeat, the same set for every system",
            "repeats": args.repeats,
            "order": "systems interleaved within each repeat",
            "seed": args.seed,
            "warmup": "one generate per system on 4 other random prompts, 4 new tokens, before timing",
        }
        print(
            f"checkpoint: {checkpoint} ({sizes['total'] / 1e6:.2f} M params); workload {args.num_prompts} prompts x "
            f"{args.prompt_len} tokens -> {args.max_new_tokens} new, {args.repeats} repeats, "
            f"{torch.get_num_threads()} thread(s)",
            flush=True,
        )

        systems = [DeepInferSystem(checkpoint, args)]
        if not args.skip_hf:
            model, load_s = load_hf(checkpoint)
            systems.append(HFSystem(model, load_s, args.num_prompts))
            if args.hf_batch1:
                systems.append(HFSystem(model, load_s, 1))
        for system in systems:
            system.generate(warmup, 4)

        seconds = {s.name: [] for s in systems}
        tokens = {s.name: [] for s in systems}
        extras = {s.name: [] for s in systems}
        for r, prompts in enumerate(prompt_sets):
            for system in systems:
                t0 = time.perf_counter()
                out, extra = system.generate(prompts, args.max_new_tokens)
                seconds[system.name].append(time.perf_counter() - t0)
                tokens[system.name] += out
                extras[system.name].append(extra)
            print(
                f"repeat {r + 1}/{args.repeats}: " + ", ".join(f"{n} {v[-1]:.2f} s" for n, v in seconds.items()),
                flush=True,
            )
        infos = {s.name: s.info for s in systems}
        del systems

    results = []
    for name, times in seconds.items():
        generated = sum(len(t) for t in tokens[name]) // args.repeats
        first = extras[name][0]
        result = dict(infos[name])
        results.append(result)
        result["seconds_per_repeat"] = times
        result["median_seconds"] = median(times)
        result["best_seconds"] = min(times)
        result["total_seconds"] = result["median_seconds"]
        result["output_tokens"] = generated
        result["output_tokens_per_s"] = generated / result["median_seconds"]
        result["output_tokens_per_s_best"] = generated / result["best_seconds"]
        for key in first:
            values = [e[key] for e in extras[name]]
            result[key] = values[0] if all(v == values[0] for v in values) else values

    copy = measure_copy_bandwidth(args.bandwidth_mb)
    matmul = measure_matmul_rate()
    bound_info = bound(sizes, copy, matmul, workload)
    lower = bound_info["lower_bound_seconds_estimate"]
    for r in results:
        r["fraction_of_bound_estimate"] = lower / r["median_seconds"]
        r["fraction_of_memory_bound_estimate"] = bound_info["memory_bound_seconds_estimate"] / r["median_seconds"]
    if not args.skip_hf:
        hf = results[1]
        for r in results:
            r["speedup_vs_hf_batched"] = hf["median_seconds"] / r["median_seconds"]

    agree = {}
    names = list(tokens)
    for other in names[1:]:
        agree[f"deepinfer_vs_{other}"] = agreement(tokens["deepinfer"], tokens[other])
    if "hf_batch1" in tokens and len(names) > 2:
        agree[f"{names[1]}_vs_hf_batch1"] = agreement(tokens[names[1]], tokens["hf_batch1"])
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
