"""Decode and prefill speed on one GPU: DeepInfer (default and batch-invariant) vs transformers, vs the bound.

One run, side by side on the same random bf16 weights (DESIGN.md §7), DeepSeek-V2-Lite dimensions written
as a DeepSeek-V3 config (27 layers, hidden 2048, MLA kv_lora 512, 64 routed experts top-6 + 2 shared):

1. weights are generated on the device in our checkpoint naming; our model is built from them and
   transformers' DeepseekV3ForCausalLM gets the same tensors assigned (fused experts shared, no copy);
2. decode: B prompts of 128 random ids, N (64) greedy tokens, EOS ignored, at B = 1, 16, 64, 256; every
   engine step timed, decode steps (no prompt tokens, all B sequences) summarised as ms/step and tok/s;
   transformers: (generate N tokens - generate 1 token) / (N - 1);
3. prefill: 16 x 1024 tokens, tokens/s and TFLOP/s;
4. bounds: bytes read per decode step over measured copy bandwidth, flops over measured GEMM peak;
5. a greedy-agreement check on a tiny float32 config (ours vs transformers, identical tokens expected).

Run: python bench/gpu_decode.py            (on a GPU; --tiny for a CPU smoke run)
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # run as a script: bench/ holds its helpers
import _gpu  # noqa: E402
from _common import machine, median, versions  # noqa: E402

from deepinfer_core.backend.registry import discover  # noqa: E402
from deepinfer_core.backend.resolve import resolve_backend  # noqa: E402
from deepinfer_core.backend.selection import select_backend  # noqa: E402
from deepinfer_core.engine.engine import Engine, EngineConfig  # noqa: E402
from deepinfer_core.engine.scheduler import SchedulerConfig  # noqa: E402
from deepinfer_core.errors import DeepInferError  # noqa: E402
from deepinfer_core.model.config import DeepseekConfig  # noqa: E402
from deepinfer_core.model.deepseek_v3 import DeepseekV3Model  # noqa: E402
from deepinfer_core.sampling.params import SamplingParams  # noqa: E402


def make_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(8, vocab, (count, length), generator=generator).tolist()  # ids < 8: BOS/EOS/pad


class _LastStep:
    """Observer keeping the engine's last StepStats, to tell prefill steps from decode steps."""

    last = None

    def on_request(self, event) -> None:
        pass

    def on_step(self, stats) -> None:
        self.last = stats


class Ours:
    """Our engine on one resolved backend; every step timed with the device synchronised around it."""

    def __init__(self, model, backend, config: EngineConfig) -> None:
        self.device, self.steps_seen = backend.torch_device, _LastStep()
        self.engine = Engine(model, backend, None, config, (), [self.steps_seen])
        self.ids = itertools.count()

    def run(self, prompts, max_tokens: int, before_step=None):
        """-> (steps [(seconds, prompt tokens, decode tokens)], generated tokens per prompt, prefix-cached tokens)."""
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        ids = [str(next(self.ids)) for _ in prompts]
        for request_id, prompt in zip(ids, prompts):
            self.engine.add_request(request_id, prompt, params)
        steps, done = [], {}
        # No synchronisation between steps: that would defeat asynchronous scheduling. A call's time is the
        # interval since the previous call returned; with asynchronous scheduling a call launches step N and
        # waits for and reports step N-1, so the interval is (in steady state) step N-1's device time, and
        # the stats it reports are step N-1's: the two stay paired. The first call reports nothing.
        _gpu.sync(self.device)
        last = time.perf_counter()
        while self.engine.has_unfinished():
            if before_step is not None:
                before_step(len(steps))
            self.steps_seen.last = None
            outputs = self.engine.step()
            now = time.perf_counter()
            stats = self.steps_seen.last
            kind = (stats.num_prefill_tokens, stats.num_decode_tokens) if stats is not None else (-1, -1)
            steps.append((now - last, *kind))
            last = now
            done.update({o.request_id: o for o in outputs if o.finished})
        return steps, [list(done[i].outputs[0].token_ids) for i in ids], sum(done[i].num_cached_tokens for i in ids)

    def decode(self, prompts, warmup_prompts, new: int) -> dict:
        self.run(warmup_prompts, 4)  # compilation / graph capture at this batch happen here, untimed
        steps, tokens, cached = self.run(prompts, new)
        batch = len(prompts)
        decode = [s for s, prompt_tokens, decoded in steps if prompt_tokens == 0 and decoded == batch]
        if not decode:
            raise RuntimeError(f"no decode step ran all {batch} sequences at once: {steps}")
        mid = median(decode)
        return {
            "ms_per_step": 1e3 * mid,
            "ms_per_step_p90": 1e3 * _gpu.percentile(decode, 0.9),
            "tokens_per_s": batch / mid,
            "decode_steps": len(decode),
            "prefill_steps": sum(1 for _, prompt_tokens, _ in steps if prompt_tokens),
            "prefill_ms": 1e3 * sum(s for s, prompt_tokens, _ in steps if prompt_tokens),
            "prefix_cached_tokens": cached,
            "tokens": tokens,
        }

    def prefill(self, prompt_sets) -> dict:
        """Prompt steps of max_tokens=1 runs; the first prompt set is an untimed warm-up at the same shape."""
        self.run(prompt_sets[0], 1)
        seconds, steps = [], 0
        for prompts in prompt_sets[1:]:
            timed = [s for s, prompt_tokens, _ in self.run(prompts, 1)[0] if prompt_tokens]
            seconds.append(sum(timed))
            steps = len(timed)
        tokens = sum(len(p) for p in prompt_sets[1])
        return {"seconds": median(seconds), "seconds_per_repeat": seconds, "steps": steps, "tokens": tokens}

    def profile(self, prompts, steps: int) -> dict:
        """torch.profiler over `steps` decode steps (after the prompt step and one decode step)."""
        from torch.profiler import ProfilerActivity, profile

        cuda = self.device.type == "cuda"
        prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
        self.run(prompts, steps + 2, before_step=lambda i: prof.start() if i == 2 else None)
        prof.stop()

        def self_us(event) -> float:  # kernels carry self device time; host ops carry none on a GPU
            if not cuda:
                return event.self_cpu_time_total
            return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)

        kernels = sorted((e for e in prof.key_averages() if self_us(e) > 0), key=self_us, reverse=True)
        total = sum(self_us(e) for e in kernels)
        top = [
            {"name": e.key, "calls_per_step": e.count / steps, "ms_per_step": self_us(e) / steps / 1e3}
            for e in kernels[:25]
        ]
        return {
            "batch": len(prompts),
            "decode_steps_profiled": steps,
            "time": "self device time of each kernel" if cuda else "self CPU time of each op (no device)",
            "total_ms_per_step": total / steps / 1e3,
            "top": [{**k, "share": k["ms_per_step"] * steps * 1e3 / total} for k in top],
        }


def hf_decode(model, prompts, new: int, device) -> dict:
    """ms per decode step of transformers' generate: (generate(new) - generate(1)) / (new - 1)."""
    ids = torch.tensor(prompts, device=device)

    def generate(n: int):
        _gpu.sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                eos_token_id=None,  # never stops early and masks no logit: our ignore_eos
                pad_token_id=0,
                use_cache=True,
            )
        _gpu.sync(device)
        return time.perf_counter() - t0, out[:, ids.shape[1] :].tolist()

    generate(2)  # warm-up at this batch
    one = min(generate(1)[0] for _ in range(2))
    full, tokens = generate(new)
    step = (full - one) / (new - 1)
    return {
        "ms_per_step": 1e3 * step,
        "tokens_per_s": len(prompts) / step,
        "seconds_generate_1": one,
        "seconds_generate_n": full,
        "tokens": tokens,
    }


def hf_prefill(model, prompt_sets, device) -> dict:
    """One forward over each [prompts, length] set, the next-token logits only; the first set warms up."""
    seconds = []
    for prompts in prompt_sets:
        ids = torch.tensor(prompts, device=device)
        _gpu.sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
        _gpu.sync(device)
        seconds.append(time.perf_counter() - t0)
    tokens = sum(len(p) for p in prompt_sets[0])
    return {"seconds": median(seconds[1:]), "seconds_per_repeat": seconds[1:], "steps": 1, "tokens": tokens}


def agreement_check(entry, device, seed: int) -> dict:
    """Tiny float32 config, same weights: our engine vs transformers' generate, greedy tokens compared."""
    dtype = torch.float32 if "float32" in entry.capabilities.dtypes else torch.bfloat16
    backend = resolve_backend(entry, dtype=dtype)
    cfg = DeepseekConfig.from_hf(_gpu.TINY_CONFIG)
    weights = _gpu.random_weights(cfg, device, dtype, seed)
    model = DeepseekV3Model(cfg, weights, backend)
    hf = _gpu.hf_model(_gpu.TINY_CONFIG, _gpu.hf_state_dict(weights, cfg, {}), device)
    prompts = make_prompts(4, 16, cfg.vocab_size, seed + 7)
    ours = Ours(model, backend, EngineConfig(num_kv_blocks=64)).run(prompts, 16)[1]
    match = _gpu.token_match(ours, hf_decode(hf, prompts, 16, device)["tokens"])
    return {
        "check": "TINY_CONFIG of bench/_gpu.py, random weights, 4 prompts x 16 ids, 16 greedy tokens: our engine "
        "on the chosen backend vs transformers generate",
        "dtype": str(dtype).removeprefix("torch."),
        "hf_agreement": match["identical_token_fraction"],
        "passed": match["identical_token_fraction"] == 1.0,
        **match,
    }


def batch_invariant_backend(entry, dtype):
    """-> (backend, None), or (None, why not)."""
    try:
        return resolve_backend(entry, dtype=dtype, batch_invariant=True), None
    except TypeError as err:  # resolve_backend predates the keyword
        return None, f"batch-invariant mode unavailable: resolve_backend does not take batch_invariant ({err})"
    except DeepInferError as err:
        return None, f"batch-invariant mode unavailable: {err}"


def parse_args(argv):
    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",") if x]

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--accelerator", default="auto", help="backend name or alias, or auto")
    p.add_argument("--tiny", action="store_true", help="tiny float32 config and workload: a CPU smoke run")
    p.add_argument("--batches", type=ints, help="decode batch sizes (default 1,16,64,256; tiny 1,4)")
    p.add_argument("--new-tokens", type=int, help="tokens generated per sequence (default 64; tiny 6)")
    p.add_argument("--prompt-len", type=int, help="decode prompt length (default 128; tiny 16)")
    p.add_argument("--prefill", type=ints, help="prefill prompts,length (default 16,1024; tiny 4,64)")
    p.add_argument("--prefill-repeats", type=int, default=3)
    p.add_argument("--hf-batches", type=ints, help="batches run with transformers (default: those <= 64)")
    p.add_argument("--skip-hf-batches", type=ints, default=[], help="leave these batches out of the transformers runs")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-ours", action="store_true", help="transformers and bounds only (no DeepInfer GPU backend)")
    p.add_argument("--skip-batch-invariant", action="store_true")
    p.add_argument("--profile", action="store_true", help="torch.profiler: top 25 kernels of our decode steps")
    p.add_argument("--profile-batches", type=ints, help="default 1,64 (tiny 1,4)")
    p.add_argument("--copy-mib", type=int, help="buffer of the copy-bandwidth measurement (default 2048; tiny 16)")
    p.add_argument("--gemm-size", type=int, help="n of the n^3 GEMM peak measurement (default 8192; tiny 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="default bench/results/gpu_decode_<device>.json")
    p.add_argument("--plot", type=Path, help="default: --out with .png")
    args = p.parse_args(argv)
    tiny = args.tiny
    defaults = {
        "batches": [1, 4] if tiny else [1, 16, 64, 256],
        "new_tokens": 6 if tiny else 64,
        "prompt_len": 16 if tiny else 128,
        "prefill": [4, 64] if tiny else [16, 1024],
        "profile_batches": [1, 4] if tiny else [1, 64],
        "copy_mib": 16 if tiny else 2048,
        "gemm_size": 256 if tiny else 8192,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.hf_batches is None:  # transformers at 256 takes long; ask for it with --hf-batches
        args.hf_batches = [b for b in args.batches if tiny or b <= 64]
    args.hf_batches = [b for b in args.hf_batches if b in args.batches and b not in args.skip_hf_batches]
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (decode steps come after the first token)")
    return args


def build(args):
    """-> (raw config, parsed config, dtype, device, backend entry or None, default backend or None)."""
    raw = _gpu.TINY_CONFIG if args.tiny else _gpu.V2_LITE_CONFIG
    dtype = torch.float32 if args.tiny else torch.bfloat16
    entry = backend = None
    if args.skip_ours:
        device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    else:
        entry = select_backend(discover(), args.accelerator)
        backend = resolve_backend(entry, dtype=dtype)
        device = backend.torch_device
    if device.type == "cpu" and not args.tiny:
        where = "no CUDA device is visible" if entry is None else f"backend {entry.name} runs on the CPU"
        sys.exit(
            f"the V2-Lite-sized model needs a GPU, but {where}: pass --accelerator with a GPU backend, "
            "--skip-ours for the transformers baseline and bounds alone, or --tiny for a CPU smoke run"
        )
    return raw, DeepseekConfig.from_hf(raw), dtype, device, entry, backend


def build_models(args, cfg, dtype, device, entry, backend) -> tuple[dict, object, dict, str | None]:
    """Ours (default, batch-invariant) and transformers on one set of weights. Peak: ~2 copies of the weights
    (ours stacks its experts; the per-expert originals are then freed), steady: ~1 + 1 per extra mode."""
    t0 = time.perf_counter()
    weights = _gpu.random_weights(cfg, device, dtype, args.seed)
    models, stacks, seconds, bi_reason = {}, {}, {"weights": time.perf_counter() - t0}, None
    if backend is not None:
        t0 = time.perf_counter()
        models["ours_default"] = (DeepseekV3Model(cfg, weights, backend), backend)
        seconds["ours_default"] = time.perf_counter() - t0
        stacks = _gpu.fused_experts(models["ours_default"][0])
        _gpu.share_expert_storage(weights, cfg, stacks)
        if args.skip_batch_invariant:
            bi, bi_reason = None, "skipped (--skip-batch-invariant)"
        else:
            bi, bi_reason = batch_invariant_backend(entry, dtype)
        if bi is not None:
            t0 = time.perf_counter()
            models["ours_batch_invariant"] = (DeepseekV3Model(cfg, weights, bi), bi)
            seconds["ours_batch_invariant"] = time.perf_counter() - t0
    hf = None
    if not args.skip_hf:
        t0 = time.perf_counter()
        hf = _gpu.hf_model(args.raw_config, _gpu.hf_state_dict(weights, cfg, stacks), device)
        seconds["hf"] = time.perf_counter() - t0
    return models, hf, seconds, bi_reason


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    raw, cfg, dtype, device, entry, backend = build(args)
    args.raw_config = raw
    dev = _gpu.device_info(device)
    name = dev.get("gpu_name", device.type)
    out = args.out or Path(f"bench/results/gpu_decode_{re.sub(r'[^a-z0-9]+', '_', name.lower()).strip('_')}.json")
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:
        args.skip_hf = True
    print(f"device {name}, backend {entry.name if entry else '-'}, {str(dtype).removeprefix('torch.')}", flush=True)

    copy = _gpu.measure_copy_bandwidth(device, args.copy_mib)
    gemm = _gpu.measure_gemm(device, dtype, args.gemm_size)
    agreement = None
    if entry is not None and not args.skip_hf:
        agreement = agreement_check(entry, device, args.seed)
        print(f"greedy agreement with transformers (tiny float32): {agreement['hf_agreement']:.3f}", flush=True)
    models, hf, build_seconds, bi_reason = build_models(args, cfg, dtype, device, entry, backend)

    prompt_len, new, (n_prefill, prefill_len) = args.prompt_len, args.new_tokens, args.prefill
    max_batch, block = max(args.batches), backend.kv_layout.block_size if backend else 1
    blocks = max_batch + max(max_batch * -(-(prompt_len + new) // block), n_prefill * -(-(prefill_len + 1) // block))
    scheduler = SchedulerConfig(  # every prompt of a batch in one step
        max_num_seqs=max(256, max_batch),
        max_num_batched_tokens=max(16384, max_batch * prompt_len, n_prefill * prefill_len),
    )
    systems = {
        key: Ours(m, b, EngineConfig(num_kv_blocks=blocks, scheduler=scheduler)) for key, (m, b) in models.items()
    }
    decode = {key: {} for key in [*systems, *(["hf"] if hf else [])]}
    for b in args.batches:
        prompts = make_prompts(b, prompt_len, cfg.vocab_size, args.seed * 1000 + b)
        warmup = make_prompts(b, prompt_len, cfg.vocab_size, args.seed * 1000 + 500 + b)
        for key, system in systems.items():
            decode[key][str(b)] = system.decode(prompts, warmup, new)
            print(f"{key} batch {b}: {decode[key][str(b)]['ms_per_step']:.2f} ms/step", flush=True)
        if hf is not None and b in args.hf_batches:
            decode["hf"][str(b)] = hf_decode(hf, prompts, new, device)
            print(f"hf batch {b}: {decode['hf'][str(b)]['ms_per_step']:.2f} ms/step", flush=True)
    prefill_sets = [
        make_prompts(n_prefill, prefill_len, cfg.vocab_size, args.seed * 1000 + 900 + r)
        for r in range(1 + args.prefill_repeats)
    ]
    prefill = {key: system.prefill(prefill_sets) for key, system in systems.items()}
    if hf is not None:
        prefill["hf"] = hf_prefill(hf, prefill_sets, device)
    profiles = None
    if args.profile and "ours_default" in systems:
        profiles = [
            systems["ours_default"].profile(make_prompts(b, prompt_len, cfg.vocab_size, args.seed * 1000 + 700 + b), 5)
            for b in args.profile_batches
        ]

    report = {
        "benchmark": "gpu_decode",
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "bench/gpu_decode.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {**machine(), "device": dev},
        "versions": {**versions(), **_gpu.extra_versions()},
        "backend": None
        if backend is None
        else {
            "name": entry.name,
            "device": backend.device.name,
            "dtype": str(dtype).removeprefix("torch."),
            "block_size": backend.kv_layout.block_size,
            "capabilities": backend.capabilities.as_dict(),
        },
        "batch_invariant": {"measured": "ours_batch_invariant" in systems, "reason": bi_reason},
        "hf": None
        if hf is None
        else {
            "attn_implementation": hf.config._attn_implementation,
            "experts_implementation": getattr(hf.config, "_experts_implementation", None),
        },
        "config": raw,
        "params": _gpu.model_sizes(cfg, dtype),
        "workload": {
            "batches": args.batches,
            "hf_batches": args.hf_batches,
            "prompt_len": prompt_len,
            "new_tokens": new,
            "prefill": [n_prefill, prefill_len],
            "prefill_repeats": args.prefill_repeats,
            "greedy": True,
            "ignore_eos": True,
            "prompts": "uniform random ids in [8, vocab); the same prompts for every system at a batch",
            "seed": args.seed,
            "engine": {
                "num_kv_blocks": blocks,
                "block_size": block,
                "max_num_seqs": scheduler.max_num_seqs,
                "max_num_batched_tokens": scheduler.max_num_batched_tokens,
                "step_budget_s": scheduler.step_budget_s,
            },
            "method": "ours: every engine.step() timed with the device synchronised before and after; decode "
            "steps = steps with no prompt tokens and all B sequences (median, p90); an untimed 4-token run at "
            "each batch first. transformers: (generate(N) - min of 2 generate(1)) / (N - 1) after a "
            "generate(2) warm-up. prefill: median over repeats after one untimed warm-up at the same shape.",
        },
        "measurements": {"copy_bandwidth": copy, "gemm": gemm, "build_seconds": build_seconds},
        "decode": decode,
        "prefill": prefill,
        "hf_agreement": agreement,
        "profile": profiles,
    }
    _gpu.summarise(report, cfg, dtype)
    if device.type == "cuda":
        report["measurements"]["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    title = f"{cfg.num_hidden_layers}-layer DeepSeek MoE, {str(dtype).removeprefix('torch.')}, {name}"
    report["plot"] = _gpu.write_plot(args.plot or out.with_suffix(".png"), decode, report["bound"]["decode"], title)
    report["wall_seconds"] = time.perf_counter() - started
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print_table(report)
    print(f"\nwrote {out} ({report['wall_seconds']:.0f} s)")
    return 0


def print_table(report: dict) -> None:
    decode, bound, comparisons = report["decode"], report["bound"]["decode"], report["comparisons"]

    def cell(key: str, b: str, field: str, width: int, digits: int) -> str:
        value = decode.get(key, {}).get(b, {}).get(field) if field else comparisons[key].get(b)
        return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"

    print(
        f"\n{'batch':>5} {'bound ms':>9} | {'ours ms':>8} {'tok/s':>8} {'x bound':>7} | {'inv ms':>7} "
        f"{'inv/def':>7} | {'hf ms':>8} {'tok/s':>7} {'x bound':>7} | {'vs hf':>6}"
    )
    for b in map(str, report["workload"]["batches"]):
        print(
            f"{b:>5} {bound[b]['bound_ms']:>9.2f} | {cell('ours_default', b, 'ms_per_step', 8, 2)} "
            f"{cell('ours_default', b, 'tokens_per_s', 8, 0)} {cell('ours_default', b, 'fraction_of_bound', 7, 2)} | "
            f"{cell('ours_batch_invariant', b, 'ms_per_step', 7, 2)} "
            f"{cell('batch_invariant_over_default_throughput', b, None, 7, 2)} | "
            f"{cell('hf', b, 'ms_per_step', 8, 2)} {cell('hf', b, 'tokens_per_s', 7, 0)} "
            f"{cell('hf', b, 'fraction_of_bound', 7, 2)} | {cell('speedup_vs_hf', b, None, 6, 2)}"
        )
    p = report["bound"]["prefill"]
    print(f"prefill {p['tokens']} tokens, bound {p['bound_ms']:.1f} ms:")
    for key, r in report["prefill"].items():
        print(f"  {key}: {r['tokens_per_s']:.0f} tok/s, {r['tflop_per_s']:.1f} TFLOP/s, {r['fraction_of_bound']:.2f}")
    if report["hf_agreement"]:
        print(f"greedy agreement with transformers (tiny float32): {report['hf_agreement']['hf_agreement']:.3f}")
    if report["batch_invariant"]["reason"]:
        print(report["batch_invariant"]["reason"])


if __name__ == "__main__":
    sys.exit(main())
