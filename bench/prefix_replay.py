"""Prefill of a long prompt whose prefix is cached: DeepSeek-V4/V4.1's exact and bounded replay vs recomputing it all.

DeepSeek-V4 and V4.1 keep no per-block copy of their sliding windows and per-sequence states: on a
prefix-cache hit the engine reuses the compressed KV blocks and recomputes tokens before the hit's end to
rebuild them (DESIGN: "SWA bounded replay"): `--prefix-replay exact` recomputes the model's `replay_tokens`
= layers x (window - 1), every token the windows at the hit's end depend on; `bounded` only the last 128
(BOUNDED_REPLAY_TOKENS, as DeepSeek's own engine), which leaves the deeper layers' windows approximate. One
run, side by side, same weights, same prompts:

- `full_recompute`: prefix caching off, the whole prompt is prefilled;
- `exact_replay`: the prefix was cached by an earlier request; the exact replay plus the new suffix are
  prefilled;
- `bounded_replay`: the same with `prefix_replay="bounded"`;
- `snapshot_restore`: the prefix was the whole prompt of an earlier request, which left a window snapshot
  at its end (engine/snapshots.py, `--window-snapshot-gb`): the hit restores it and only the suffix is
  prefilled, exactly (the replay systems above run without snapshots);
- `full_recompute_every_layer`: full_recompute with every layer computing every token (`needed_from`
  cleared): against full_recompute, what DeepSeek-V4.1's CED prefill saves (V4 has nothing to skip);
- `floor_no_replay`: the same hit with the replay switched off. Its output is WRONG (the windows are
  stale); it is the floor that storing every window per block would reach, for timing only.
- `full_recompute_other_chunks`: the full prefill in half-size chunks: how far rounding alone moves logits.

For each: prefill tokens actually computed (from the scheduler), median / best seconds over rounds (a
fresh suffix each round, so the hit is always exactly the shared prefix), and the first token's logprob,
which must agree between full_recompute and exact_replay. Bounded replay's drift is measured against exact
replay over the vocabulary (largest |logprob difference|, KL divergence, whether the greedy token agrees): at the
first token past the hit (a probe prompt that ends one token after it, where the drift is largest) and at
the end of the timed prompts (suffix_len tokens past it). The report also gives the token saving the same
prompt would see at the Flash model's depth (V4 Flash: 43 layers, V4.1 Flash: 40; 128-token window).

Run: python bench/prefix_replay.py --prompt-len 2048 --out /tmp/prefix_replay.json
(`--model v41`, `--model v41-40layers`: DeepSeek-V4.1 at tiny widths, 8 layers or V4.1 Flash's 40;
bench/README.md has the commands behind the results files.)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # run as a script: bench/ holds its helpers
from _common import machine, median, versions  # noqa: E402
from _replay_models import FLASH_LAYERS, MODELS, block_size, is_v41, make_checkpoint  # noqa: E402

from deepinfer_core.engine.block_manager import BOUNDED_REPLAY_TOKENS  # noqa: E402
from deepinfer_core.engine.llm import LLM  # noqa: E402
from deepinfer_core.model.config_v41 import DeepseekV41Config  # noqa: E402
from deepinfer_core.model.v41_skip import layer_starts  # noqa: E402
from deepinfer_core.sampling.params import SamplingParams  # noqa: E402

HITS = ("exact_replay", "bounded_replay", "snapshot_restore")  # the systems with a prefix hit
PARAMS = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON report path")
    parser.add_argument("--model", choices=sorted(MODELS), default="v4", help="the random-weights model")
    parser.add_argument("--prompt-len", type=int, default=4096, help="tokens in the measured prompt")
    parser.add_argument("--suffix-len", type=int, default=128, help="its tokens past the cached prefix")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per system")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--config", default="{}", help="JSON overrides of the model config")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--accelerator", default="cpu", help="backend to run on (default: the cpu reference)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    return parser


def every_layer(llm: LLM) -> LLM:
    """`llm` with CED prefill off: its steps say every position is needed, so no layer skips a token."""
    runner = llm.engine.runner
    prepare = runner.prepare

    def prepare_all(*args, **kwargs):
        batch = prepare(*args, **kwargs)
        return dataclasses.replace(batch, meta=dataclasses.replace(batch.meta, needed_from=None))

    runner.prepare = prepare_all
    return llm


def ced_rows(raw: dict, prompt_len: int) -> float | None:
    """The fraction of (layer, token) rows a V4.1 full prefill of `prompt_len` tokens computes with CED."""
    if not is_v41(raw):
        return None
    starts = layer_starts(DeepseekV41Config.from_hf(raw), [prompt_len - 1], [0])
    return sum(prompt_len - max(0, s[0]) for s in starts) / (len(starts) * prompt_len)


def record_logprobs(llm: LLM) -> list[torch.Tensor]:
    """From now on, the logprobs [V] of every token the engine samples, in order."""
    seen, logits = [], llm.model.logits
    llm.model.logits = lambda hidden: (out := logits(hidden), seen.append(out[-1].float().log_softmax(-1).cpu()))[0]
    return seen


def run_system(
    name: str, llm: LLM, prefix: list[int], suffixes: list[list[int]], warm: list[int] | None, warm_up: list[int]
) -> tuple[dict, list[torch.Tensor]]:
    """Time the prefill (one sampled token) of prefix + each suffix; `warm` first caches the prefix.
    `warm_up` runs once untimed first. Returns the report and each round's first-token logprobs [V]."""
    llm.generate([warm_up], PARAMS)  # compiles and caches kernels; its tokens share nothing with the prompts
    scheduler = llm.engine.scheduler
    schedule, steps = scheduler.schedule, []
    scheduler.schedule = lambda *a: steps.append(schedule(*a)) or steps[-1]  # records every step
    logprobs = record_logprobs(llm)
    seconds, computed, cached, first, rows = [], [], [], [], []
    for suffix in suffixes:
        if warm is not None:
            llm.generate([prefix + warm], PARAMS)  # puts the prefix in the cache (untimed)
        steps.clear()
        start = time.perf_counter()
        output = llm.generate([prefix + suffix], PARAMS)[0]
        seconds.append(time.perf_counter() - start)
        rows.append(logprobs[-1])
        computed.append(sum(step.num_tokens for step in steps))
        cached.append(output.num_cached_tokens)
        first.append((output.outputs[0].token_ids[0], output.outputs[0].token_logprobs[0]))
    report = {
        "system": name,
        "replay_tokens": llm.engine.blocks.replay_tokens if llm.engine.blocks.enable_prefix_caching else None,
        "seconds": seconds,
        "median_seconds": median(seconds),
        "best_seconds": min(seconds),
        "prefill_tokens_computed": computed,
        "cached_tokens": cached,
        "first_token_and_logprob": first,
    }
    return report, rows


def probe(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Logprobs [V] of the token after `prompt` (its cached prefix was put there by run_system)."""
    logprobs = record_logprobs(llm)
    llm.generate([prompt], PARAMS)
    return logprobs[-1]


def drift(got: torch.Tensor, want: torch.Tensor) -> dict:
    """max |logprob difference| over the vocabulary, KL(want || got), and whether the greedy tokens agree."""
    return {
        "max_abs_logprob_diff": (got - want).abs().max().item(),
        "kl_divergence": (want.exp() * (want - got)).sum().item(),
        "greedy_agrees": bool(got.argmax() == want.argmax()),
    }


def flash_estimate(raw: dict, prompt_len: int, suffix_len: int) -> dict:
    """The prefill tokens exact and bounded replay would save at the Flash model's depth (a count, not a time)."""
    layers = FLASH_LAYERS[raw["architectures"][0]]
    exact = layers * (128 - 1)  # layers x (window - 1): the window reach (127) exceeds every other look-back

    def saved(replay: int) -> dict:
        return {n: max(0, n - suffix_len - replay) / n for n in (prompt_len, 8192, 11264, 32768, 131072)}

    return {
        "layers": layers,
        "exact_replay_tokens": exact,
        "bounded_replay_tokens": BOUNDED_REPLAY_TOKENS,
        "prefill_tokens_saved_fraction_by_prompt_len": {"exact": saved(exact), "bounded": saved(BOUNDED_REPLAY_TOKENS)},
        "note": f"{layers} layers x (128 - 1) replayed tokens exactly, or 128 bounded; a hit on all but the last "
        "suffix_len tokens; a count, not a measured time",
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    raw = {**MODELS[args.model], **json.loads(args.config)}
    block = block_size(raw)
    generator = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(2, raw["vocab_size"], (n,), generator=generator).tolist()

    prefix = tokens(args.prompt_len - args.suffix_len)
    suffixes = [tokens(args.suffix_len) for _ in range(args.repeats)]
    warm = tokens(args.suffix_len)
    warm_up = tokens(min(args.prompt_len, 1024))
    at_hit = prefix[: len(prefix) // block * block] + tokens(1)  # ends one token past its hit
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

        systems = {
            "full_recompute": (llm(enable_prefix_caching=False), None),
            "full_recompute_every_layer": (every_layer(llm(enable_prefix_caching=False)), None),
            "exact_replay": (llm(window_snapshot_gb=0), warm),
            "bounded_replay": (llm(prefix_replay="bounded", window_snapshot_gb=0), warm),
            "snapshot_restore": (llm(), []),  # the earlier request's prompt is the prefix itself
            "floor_no_replay": (llm(window_snapshot_gb=0), warm),
            # the same full prefill in other chunks: how far rounding alone moves the first logprob
            "full_recompute_other_chunks": (
                llm(enable_prefix_caching=False, max_num_batched_tokens=max(block, args.max_num_batched_tokens // 2)),
                None,
            ),
        }
        systems["floor_no_replay"][0].engine.blocks.replay_tokens = 0  # wrong output: the floor of stored windows
        full_llm = systems["full_recompute"][0]
        results, rows, probes = [], {}, {}
        for name, (engine, warm_with) in systems.items():
            report, rows[name] = run_system(name, engine, prefix, suffixes, warm_with, warm_up)
            results.append(report)
            if name in ("full_recompute", "exact_replay", "bounded_replay"):
                probes[name] = probe(engine, at_hit)
        exact_replay_tokens = systems["exact_replay"][0].model.replay_tokens
    by_name = {r["system"]: r for r in results}
    full = by_name["full_recompute"]
    firsts = {r["system"]: r["first_token_and_logprob"] for r in results}

    def gaps(name: str) -> list[float]:
        return [abs(a[1] - b[1]) for a, b in zip(firsts["full_recompute"], firsts[name])]

    noise = gaps("full_recompute_other_chunks")
    # exact in real arithmetic; allowed: the dtype's tolerance, or twice the largest move re-chunking alone
    # made (on deep random models rounding differences grow layer by layer)
    allowed = max(1e-4 if args.dtype == "float32" else 5e-2, 2 * max(noise))
    # the greedy token must agree too, unless re-chunking alone changed it in that round (a near tie: seen on
    # DeepSeek-V4.1 at 40 random layers, whose FP8/FP4 roundings turn tiny differences into flips)
    tie = [a[0] != b[0] for a, b in zip(firsts["full_recompute"], firsts["full_recompute_other_chunks"])]
    agree = [
        (a[0] == b[0] or tied) and gap <= allowed
        for name in ("exact_replay", "snapshot_restore")
        for a, b, gap, tied in zip(full["first_token_and_logprob"], firsts[name], gaps(name), tie)
    ]

    def saved(system: dict, key: str) -> float:
        return 1 - median(system[key]) / median(full[key]) if key != "median_seconds" else 1 - system[key] / full[key]

    report = {
        "benchmark": "prefix_replay",
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "machine": machine(),
        "versions": versions(),
        "backend": full_llm.backend.info.name,
        "device": full_llm.backend.device.name,
        "dtype": args.dtype,
        "model": args.model,
        "config": raw,
        "workload": {
            "prompt_len": args.prompt_len,
            "suffix_len": args.suffix_len,
            "repeats": args.repeats,
            "block_size": block,
            "probe_hit_tokens": len(at_hit) - 1,
        },
        "replay_tokens": exact_replay_tokens,
        "bounded_replay_tokens": min(exact_replay_tokens, BOUNDED_REPLAY_TOKENS),
        "results": results,
        "first_token_agrees_full_vs_exact_replay_and_snapshot_restore": agree,
        "first_logprob_gap_vs_full": {
            "exact_replay": gaps("exact_replay"),
            "bounded_replay": gaps("bounded_replay"),
            "snapshot_restore": gaps("snapshot_restore"),
            "floor_no_replay": gaps("floor_no_replay"),
            "full_recompute_other_chunks (rounding noise)": noise,
            "allowed": allowed,
            "rounding_alone_changed_the_greedy_token": tie,
        },
        "bounded_drift_vs_exact": {
            "first_token_past_the_hit": drift(probes["bounded_replay"], probes["exact_replay"]),
            "end_of_timed_prompts": [drift(b, e) for b, e in zip(rows["bounded_replay"], rows["exact_replay"])],
            "rounding_noise_exact_vs_full_first_token_past_the_hit": drift(
                probes["exact_replay"], probes["full_recompute"]
            ),
            "rounding_noise_other_chunks_vs_full_end_of_timed_prompts": [
                drift(o, f) for o, f in zip(rows["full_recompute_other_chunks"], rows["full_recompute"])
            ],
        },
        "prefill_tokens_saved_fraction": {name: saved(by_name[name], "prefill_tokens_computed") for name in HITS},
        "time_saved_fraction": {name: saved(by_name[name], "median_seconds") for name in HITS},
        "ced_prefill": {
            "rows_computed_fraction": ced_rows(raw, args.prompt_len),
            "time_saved_fraction": 1
            - by_name["full_recompute"]["median_seconds"] / by_name["full_recompute_every_layer"]["median_seconds"],
            "rows_computed_fraction_at_flash_depth": {
                n: ced_rows(MODELS["v41-40layers"], n) for n in (8192, 32768, 131072)
            },
        },
        "flash_estimate": flash_estimate(raw, args.prompt_len, args.suffix_len),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    ced = report["ced_prefill"]
    if ced["rows_computed_fraction"] is not None:
        print(
            f"CED prefill: {ced['rows_computed_fraction']:.1%} of the layer x token rows, "
            f"{ced['time_saved_fraction']:.1%} of full recompute's time saved"
        )
    print(f"{'system':28} {'median s':>9} {'best s':>9} {'tokens':>8} {'cached':>7}")
    for r in results:
        computed, hit = median(r["prefill_tokens_computed"]), r["cached_tokens"][0]
        print(f"{r['system']:28} {r['median_seconds']:9.3f} {r['best_seconds']:9.3f} {computed:8.0f} {hit:7d}")
    at_hit_drift = report["bounded_drift_vs_exact"]["first_token_past_the_hit"]
    tokens_saved, time_saved = report["prefill_tokens_saved_fraction"], report["time_saved_fraction"]
    print(
        f"replay {exact_replay_tokens} tokens exact, {report['bounded_replay_tokens']} bounded; saved (exact / "
        f"bounded / snapshot) {' / '.join(f'{tokens_saved[n]:.1%}' for n in HITS)} of prefill tokens, "
        f"{' / '.join(f'{time_saved[n]:.1%}' for n in HITS)} of time; exact's and the snapshot's first token "
        f"agree with full: {all(agree)}; bounded's drift past the hit: "
        f"{at_hit_drift['max_abs_logprob_diff']:.2e}, greedy token agrees: {at_hit_drift['greedy_agrees']}"
    )
    return 0 if all(agree) else 1


if __name__ == "__main__":
    sys.exit(main())
