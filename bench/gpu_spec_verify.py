"""Fixed vs adaptive verification of speculative decoding through DeepInfer's engine on one GPU, with SIMULATED
acceptance (issue #17): DeepSeek-V4.1 at Flash width, plain decoding, verifying all k = 5 drafts and adaptive
verification at 16-96 sequences; decode tokens/s, drafts verified per step, JSON naming the machine, a plot.

    python bench/gpu_spec_verify.py --commit <sha>        # on the H200: bench/results/gpu_spec_verify_nvidia_h200.*
    python bench/gpu_spec_verify.py --tiny --out /tmp/s.json   # CPU smoke run (tests/bench)

Real: the model (DeepSeek-V4.1 at its released width, 5 layers, 32 experts, bf16, random weights generated on the
device as gpu_decode.py --model v41 builds it, bench/_gpu_v4.py), the engine (scheduler, runner, sampler, caches;
verify steps of the drafts it is given; the planner with the step-cost tables it profiled at start-up) and the time,
each mode as the engine runs it: speculating, verify steps replay device graphs (every sequence padded to the
step's most drafts; adaptive verification then picks the step's depth from costs profiled per depth); plain decoding
replays device graphs and is scheduled asynchronously. With a draft model (--drafter dspark) the speculative engines
schedule asynchronously too (--spec-scheduling sync: synchronously): a verify step is planned while the one before
runs and takes its drafts on the device, where the profile drafts below are then looked up (DeviceDrafts: by each
sequence's newest token and its position); adaptive verification plans with the confidences read back a step
before. Without one (ngram's config) they schedule synchronously.

SIMULATED: the drafts and how many are accepted. Random weights accept almost no real draft, so a proposer
(bench/_spec_drafts.py) drafts from the target's own greedy continuation (the plain run of the same prompts): at
each output position of each request it draws a difficulty u ~ U(0, 1); draft j is the true token, given drafts
1..j-1 were, with probability c_j = clip(base_j + spread (0.5 - u), 0.02, 0.98), base 0.90 / 0.82 / 0.74 / 0.66 /
0.58 (spec_planner_sim.py's); from the first wrong draft on every draft is wrong (true + 1). The request's
next_draft_confidence carries c_1..c_k, so the planner sees oracle-calibrated confidences (what DSpark's
confidence head is trained to give). The draws are made before the runs, per prompt and position: fixed and
adaptive read the same ones wherever they reach the same position. Coupled acceptance keeps exactly the right
drafts a step verifies, so the output is plain decoding's token for token where verify and decode steps round
alike; where a verify step picks another, near-tied token (bf16 on the device), an untimed plain engine on the
same weights generates the continuation of the request's actual output again (`oracle_refreshes`), and
`fidelity` = accepted / intended drafts says how much acceptance that cost. The drafts cost no device time: a real
drafter's forward is not in these numbers.

Timing: every engine.step() call is timed on the host, and each call ends by reading a step's tokens back (the
step it launched, scheduling synchronously; scheduling asynchronously the step before, so a call's interval is that
step's time). The decode phase is the steps without prompt tokens; `tokens_per_s` = tokens those steps
yielded / their seconds, over the steps in which all B sequences run (steady state; `tokens_per_s_whole` adds the
tail, where sequences that finished early have left the batch). The oracle's refreshes and the benchmark's
bookkeeping are subtracted from the step they ran in. At each batch every engine first runs other prompts
untimed (graph capture, kernel compilation), then `--repeats` rounds of fresh prompts: plain, then fixed and
adaptive (their order alternating); medians over rounds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from time import perf_counter

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: bench/ holds its helpers
import _gpu_v4 as models  # noqa: E402
from _common import machine, versions  # noqa: E402
from _gpu_measure import device_info, extra_versions, sync, token_match  # noqa: E402
from _gpu_runners import _LastStep, make_prompts  # noqa: E402
from _spec_drafts import Continuations, DeviceDrafts, ProfileDrafts, VerifyLog, draw_profile  # noqa: E402
from _spec_report import Step, combine, decode_summary, git_head, plot, step_costs, workload  # noqa: E402
from spec_planner_sim import BASE  # noqa: E402

from deepinfer_core.backend.registry import discover  # noqa: E402
from deepinfer_core.backend.resolve import resolve_backend  # noqa: E402
from deepinfer_core.backend.selection import select_backend  # noqa: E402
from deepinfer_core.engine.engine import Engine, EngineConfig  # noqa: E402
from deepinfer_core.engine.scheduler import SchedulerConfig  # noqa: E402
from deepinfer_core.engine.speculative import SpeculativeConfig  # noqa: E402
from deepinfer_core.model.dspark import DSparkDrafter, dspark_weight_shapes  # noqa: E402
from deepinfer_core.sampling.params import SamplingParams  # noqa: E402

MODES = ("plain", "fixed", "adaptive")
# --drafter dspark: DSpark's released shape (3 stages, block 5, Markov rank 256, top-3) with 32 of its 128 experts
# (as the backbone keeps 32 of 384), reading the stream means of backbone layers 1, 2 and 4
DSPARK = {"num_nextn_predict_layers": 3, "dspark_target_layer_ids": [1, 2, 4], "dspark_n_routed_experts": 32}
DSPARK_TINY = {**DSPARK, "dspark_n_routed_experts": 8, "dspark_num_experts_per_tok": 2, "dspark_noise_token_id": 5,
               "dspark_markov_rank": 8}  # fmt: skip
DRAFTERS = {
    "none": "no draft model runs: the drafts cost no device time",
    "dspark": "DSpark draft layers (random weights) run every step, in the speculative engines' draft graphs where "
    "the target step replayed one: catch-up and a block of k drafts; their drafts are then replaced by the profile "
    "drafts, so the acceptance is still SIMULATED but the drafter's time is real",
}
SPECULATIVE = ("fixed", "adaptive")
# with a draft model scheduled asynchronously, fixed-k scheduled synchronously too, in the same run: the baseline
SYNC_BASELINE = "fixed_sync"
DEEPSEEK_REPORTED = (
    "DeepSeek's adaptive verification with DSpark drafts, as quoted in bench/README.md (spec_planner_sim.py's "
    "section): -1.5% at 16 sequences to +11% at 96, +4-7% at ~60; 3.2-4.4 of 5 drafts verified"
)


@dataclass(slots=True)
class System:
    """An engine under test, the observer that tells its prefill steps apart, and (speculating) its VerifyLog and,
    where its steps are pipelined, the drafts it finds on the device."""

    engine: Engine
    watch: _LastStep
    log: VerifyLog | None = None
    device_drafts: DeviceDrafts | None = None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",") if x]

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--commit", help="the commit measured (the device's checkout may not know it)")
    p.add_argument("--accelerator", default="auto", help="backend name or alias, or auto")
    p.add_argument("--tiny", action="store_true", help="tiny float32 V4.1 and workload: a CPU smoke run")
    p.add_argument("--batches", type=ints, help="concurrent sequences (default 16,32,64,96; tiny 2,3)")
    p.add_argument("--prompt-len", type=int, help="random prompt ids per sequence (default 256; tiny 16)")
    p.add_argument("--max-tokens", type=int, help="tokens generated per sequence (default 128; tiny 16)")
    p.add_argument("--warmup-tokens", type=int, help="tokens of the untimed run at each batch (default 16; tiny 8)")
    p.add_argument("--repeats", type=int, help="timed rounds per batch, fresh prompts each (default 3; tiny 1)")
    p.add_argument("--k", type=int, default=5, help="drafts per request (DSpark's block: 5)")
    p.add_argument(
        "--drafter",
        choices=("none", "dspark"),
        default="none",
        help="dspark: the speculative engines also run DSpark draft layers (random weights, 3 stages, 32 experts) "
        "every step; the profile drafts replace their drafts, not their cost",
    )
    p.add_argument(
        "--spec-scheduling",
        choices=("async", "sync"),
        default="async",
        help="async: the speculative engines schedule asynchronously where they can (a draft model's steps are "
        "pipelined; ngram's never are); sync: they wait for every step's tokens before planning the next",
    )
    p.add_argument("--spread", type=float, default=0.6, help="how much a position's difficulty moves acceptance")
    p.add_argument("--oracle-horizon", type=int, default=16, help="tokens a refreshed continuation runs ahead")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="default bench/results/gpu_spec_verify_<device>.json")
    p.add_argument("--plot", type=Path, help="default: --out with .png")
    args = p.parse_args(argv)
    defaults = {
        "batches": [2, 3] if args.tiny else [16, 32, 64, 96],
        "prompt_len": 16 if args.tiny else 256,
        "max_tokens": 16 if args.tiny else 128,
        "warmup_tokens": 8 if args.tiny else 16,
        "repeats": 1 if args.tiny else 3,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = perf_counter()
    family, raw = models.FAMILIES["v41"], models.CONFIGS["v41"][1 if args.tiny else 0]
    if args.drafter == "dspark":
        raw = {**raw, **(DSPARK_TINY if args.tiny else DSPARK)}
    cfg = family.parse(raw)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    entry = select_backend(discover(), args.accelerator)
    backend = resolve_backend(entry, dtype=dtype)
    device = backend.torch_device
    if device.type == "cpu" and not args.tiny:
        sys.exit(f"DeepSeek-V4.1 at Flash width needs a GPU, but backend {entry.name} runs on the CPU: pass "
                 "--accelerator with a GPU backend, or --tiny for a CPU smoke run")  # fmt: skip
    dev = device_info(device)
    name = dev.get("gpu_name", device.type)
    out = args.out or Path(f"bench/results/gpu_spec_verify_{re.sub(r'[^a-z0-9]+', '_', name.lower()).strip('_')}.json")
    print(f"{family.title}, device {name}, backend {entry.name}, {_name(dtype)}", flush=True)

    t0 = perf_counter()
    model, _ = models.build_ours(family, cfg, models.random_weights(family, cfg, device, dtype, args.seed), backend)
    build = {"model_s": perf_counter() - t0}
    drafter = None
    if args.drafter == "dspark":
        t0 = perf_counter()
        weights = models.random_tensors(dspark_weight_shapes(cfg), family.float32_weights, cfg, device, dtype,
                                        args.seed + 1)  # fmt: skip
        drafter = DSparkDrafter(model, weights, backend)
        build["drafter_s"] = perf_counter() - t0
    systems, oracle = build_systems(model, backend, args, build, drafter)

    batches = {}
    report = {
        "benchmark": "gpu_spec_verify",
        "simulated": "acceptance is SIMULATED (profile drafts, see method); the model, the engine's verify steps, "
        "the planner and the times are real",
        "commit": args.commit or "not given (--commit)",
        "git_head": git_head(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "bench/gpu_spec_verify.py", *(argv if argv is not None else sys.argv[1:])]),
        "method": __doc__.split("\n\n", 2)[2].strip(),
        "machine": {**machine(), "device": dev},
        "versions": {**versions(), **extra_versions()},
        "backend": {"name": entry.name, "dtype": _name(dtype), "block_size": backend.kv_layout.block_size},
        "model": {"title": family.title, "width": "tiny" if args.tiny else "Flash (released)", "config": raw},
        "drafter": DRAFTERS[args.drafter],
        "spec_scheduling": {
            mode: "asynchronous: a draft model's verify steps pipelined, their drafts looked up on the device"
            if systems[mode].engine.async_scheduling
            else "synchronous"
            for mode in systems
            if mode != "plain"
        },
        "workload": workload(args, systems["plain"].engine.config),
        "acceptance": {
            "simulated": True,
            "base_by_position": [BASE[min(j, len(BASE) - 1)] for j in range(args.k)],
            "spread": args.spread,
            "clip": [0.02, 0.98],
            "wrong_draft": "true token + 1 (mod vocab)",
        },
        "step_costs": step_costs(systems["adaptive"].engine),
        "build_seconds": build,
        "batches": batches,
        "deepseek_reported": DEEPSEEK_REPORTED,
    }
    title = f"{family.title} ({'tiny' if args.tiny else 'Flash width'}, random weights), {name}"
    out.parent.mkdir(parents=True, exist_ok=True)
    for b in args.batches:
        t0 = perf_counter()
        batches[str(b)] = row = measure_batch(systems, oracle, b, args, cfg.vocab_size, device)
        print(f"batch {b} ({perf_counter() - t0:.0f} s): plain {row['plain']['tokens_per_s']:.0f} tok/s, "
              f"fixed-{args.k} {row['fixed']['tokens_per_s']:.0f}, adaptive {row['adaptive']['tokens_per_s']:.0f} "
              f"({100 * row['adaptive_vs_fixed']:+.1f}%), drafts verified "
              f"{row['adaptive']['drafts_verified_per_request_step']:.2f} of {args.k}"
              + (f"; fixed-{args.k} scheduled synchronously {row[SYNC_BASELINE]['tokens_per_s']:.0f}"
                 if SYNC_BASELINE in row else ""), flush=True)  # fmt: skip
        if device.type == "cuda":
            report["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        report["plot"] = plot(args.plot or out.with_suffix(".png"), batches, args.k, title)
        report["wall_seconds"] = perf_counter() - started
        out.write_text(json.dumps(report, indent=1) + "\n")  # after every batch: a run cut short keeps the rest
    print(f"wrote {out} ({report['wall_seconds']:.0f} s)")
    return 0


def build_systems(model, backend, args, seconds: dict, drafter=None) -> tuple[dict[str, System], Engine]:
    """The plain, fixed and adaptive engines on `model` (with a draft model scheduled asynchronously, also fixed
    scheduled synchronously: SYNC_BASELINE), and the oracle (a plain engine for Continuations); each one's build
    time goes to `seconds` (adaptive's includes its start-up step-cost profile). `drafter`: the speculative
    engines' draft model (its drafts are replaced by the profile drafts; its work is not)."""
    systems, oracle, device_drafts, modes = {}, None, None, MODES
    if drafter is not None and args.spec_scheduling == "async":  # one table: the engines share the drafter
        capacity = 4 * max(args.batches) * (max(args.max_tokens, args.warmup_tokens) + args.k + 1)
        device_drafts = DeviceDrafts(drafter, args.k, model.config.vocab_size, capacity, backend.torch_device)
        modes = (*MODES, SYNC_BASELINE)
    for mode in (*modes, "oracle"):
        t0 = perf_counter()
        verify = "fixed" if mode == SYNC_BASELINE else mode
        spec = None if mode in ("plain", "oracle") else _speculative(args.k, verify, drafter is not None)
        watch = _LastStep()
        config = _engine_config(args, backend.kv_layout.block_size, spec)
        if spec is not None:  # async: wherever the engine can (it is the backend's default, forced on a CPU smoke run)
            config = replace(config, async_scheduling=args.spec_scheduling == "async" and mode != SYNC_BASELINE)
        engine = Engine(model, backend, None, config, (), [watch], drafter=drafter if spec else None)
        seconds[f"{mode}_engine_s"] = perf_counter() - t0
        if mode == "oracle":
            oracle = engine
        elif spec is None:
            systems[mode] = System(engine, watch)
        else:
            pipelined = device_drafts if engine.async_scheduling else None
            systems[mode] = System(engine, watch, VerifyLog(engine.scheduler, args.k), pipelined)
    return systems, oracle


def _speculative(k: int, verify: str, dspark: bool) -> SpeculativeConfig:
    """ngram's config (no draft model) or dspark's; the benchmark swaps the proposer for ProfileDrafts."""
    return SpeculativeConfig(method="dspark" if dspark else "ngram", num_speculative_tokens=k, verify=verify)


def _engine_config(args, block: int, speculative: SpeculativeConfig | None) -> EngineConfig:
    """KV blocks for the largest batch at full length; every prompt of a batch may be computed in one step."""
    most = max(args.batches)
    per_sequence = -(-(args.prompt_len + args.max_tokens + args.k + 1) // block)
    scheduler = SchedulerConfig(
        max_num_seqs=most, max_num_batched_tokens=max(16384, most * (args.prompt_len + args.max_tokens))
    )
    return EngineConfig(
        num_kv_blocks=most * (per_sequence + 1), window_snapshot_bytes=0, scheduler=scheduler, speculative=speculative
    )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- runs ---------------------------------------------------------------------------------------


def measure_batch(systems: dict[str, System], oracle: Engine, batch: int, args, vocab: int, device) -> dict:
    """Warm-up, then `repeats` rounds of plain / fixed / adaptive on fresh prompts -> {mode: result, gains}."""
    warm = make_prompts(batch, args.prompt_len, vocab, args.seed * 100_000 + batch * 100 + 99)
    _, warm_tokens = run(systems["plain"], warm, args.warmup_tokens, device)
    speculative = [mode for mode in systems if mode != "plain"]
    for mode in speculative:
        draws = _draws(args, batch, "warm-up", args.warmup_tokens)
        run_speculative(systems[mode], oracle, warm, warm_tokens, draws, args.warmup_tokens, args, device)
    rounds = {mode: [] for mode in systems}
    for r in range(args.repeats):
        prompts = make_prompts(batch, args.prompt_len, vocab, args.seed * 100_000 + batch * 100 + r)
        steps, plain_tokens = run(systems["plain"], prompts, args.max_tokens, device)
        rounds["plain"].append(decode_summary(steps, batch))
        draws = _draws(args, batch, r, args.max_tokens)
        for mode in speculative if r % 2 == 0 else speculative[::-1]:
            result = run_speculative(systems[mode], oracle, prompts, plain_tokens, draws, args.max_tokens, args, device)
            rounds[mode].append(result)
    row = {mode: combine(rounds[mode]) for mode in systems}
    rate = {mode: row[mode]["tokens_per_s"] for mode in systems}
    row["adaptive_vs_fixed"] = rate["adaptive"] / rate["fixed"] - 1
    row["fixed_vs_plain"] = rate["fixed"] / rate["plain"] - 1
    row["adaptive_vs_plain"] = rate["adaptive"] / rate["plain"] - 1
    if SYNC_BASELINE in rate:
        row["fixed_async_vs_sync"] = rate["fixed"] / rate[SYNC_BASELINE] - 1
    return row


def _draws(args, batch: int, round_: int | str, max_tokens: int) -> dict:
    return {str(i): draw_profile(f"{args.seed}/{batch}/{round_}/{i}", max_tokens, args.k, args.spread)
            for i in range(batch)}  # fmt: skip


def run(system: System, prompts: list[list[int]], max_tokens: int, device) -> tuple[list[Step], dict]:
    """All prompts at once (request ids "0", "1", ...), greedy, EOS ignored; every step() call timed ->
    (steps, {request id: output tokens})."""
    engine = system.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    steps, tokens = [], {}
    sync(device)
    last = perf_counter()
    while engine.has_unfinished():
        system.watch.last = None
        excluded = system.log.excluded_s if system.log else 0.0
        outputs = engine.step()
        now = perf_counter()
        excluded = system.log.excluded_s - excluded if system.log else 0.0
        stats = system.watch.last
        prompt_tokens = stats.num_prefill_tokens if stats is not None else -1
        yielded = sum(len(o.new_token_ids) for o in outputs)
        steps.append(Step(now - last - excluded, prompt_tokens, len(outputs), yielded))
        last = now
        tokens.update({o.request_id: list(o.outputs[0].token_ids) for o in outputs if o.finished})
    return steps, tokens


def run_speculative(system: System, oracle: Engine, prompts, plain_tokens: dict, draws: dict, max_tokens: int, args,
                    device) -> dict:  # fmt: skip
    """One run with ProfileDrafts drafting from the plain run's tokens -> decode summary, drafts, acceptance."""
    on_refresh, table = None, system.device_drafts
    if table is not None:  # pipelined steps take the profile drafts on the device
        table.reset()
        for i, tokens in plain_tokens.items():
            table.add(len(prompts[int(i)]), tokens, draws[i], 0)
        table.push()

        def on_refresh(request, tokens):  # drafts after its newest known token on, along its new continuation
            newest = len(request.output_token_ids) - 1
            table.add(len(request.prompt_token_ids), tokens, draws[request.request_id], newest)

    continuations = Continuations(plain_tokens, oracle, args.oracle_horizon, on_refresh)
    system.log.start(ProfileDrafts(continuations, draws, system.engine.model.config.vocab_size), table)
    stats = system.engine.spec_stats  # counts since the engine started
    before = replace(stats, accepted_per_position=list(stats.accepted_per_position or [0] * args.k))
    steps, tokens = run(system, prompts, max_tokens, device)
    per_position = [a - b for a, b in zip(stats.accepted_per_position or [], before.accepted_per_position)]
    accepted = stats.num_accepted_tokens - before.num_accepted_tokens
    counts = system.log.counts
    ids = sorted(plain_tokens, key=int)
    return {
        **decode_summary(steps, len(prompts)),
        "request_steps": counts.request_steps,
        "drafts_offered_per_request_step": counts.offered / counts.request_steps,
        "drafts_verified_per_request_step": counts.admitted / counts.request_steps,
        "drafts_verified_with_room_for_all": counts.full_room_admitted / counts.full_room_steps
        if counts.full_room_steps
        else None,
        "tokens_per_request_step": 1 + accepted / counts.request_steps,
        "spec_stats": {
            "num_drafts": stats.num_drafts - before.num_drafts,
            "num_draft_tokens": stats.num_draft_tokens - before.num_draft_tokens,
            "num_accepted_tokens": accepted,
            "accepted_per_position": per_position,
        },
        "pipelined_request_steps": counts.pipelined,
        "intended_accepted": counts.intended if not counts.pipelined else None,  # pipelined drafts: not counted
        "fidelity": accepted / counts.intended if counts.intended and not counts.pipelined else None,
        "oracle_refreshes": continuations.num_refreshed,
        "excluded_s": system.log.excluded_s,
        "plain_match": token_match([plain_tokens[i] for i in ids], [tokens[i] for i in ids]),
    }


if __name__ == "__main__":
    sys.exit(main())
