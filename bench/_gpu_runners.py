"""Runners of gpu_decode.py: our engine timed step by step, transformers' generate/forward, agreement checks."""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import sys
import time

import _gpu
import torch
from _common import machine, median, versions
from _gpu_measure import extra_versions, gpu_state, percentile, sync, token_match

from deepinfer_core.backend.registry import discover
from deepinfer_core.backend.resolve import resolve_backend
from deepinfer_core.backend.selection import select_backend
from deepinfer_core.engine.engine import Engine, EngineConfig
from deepinfer_core.engine.scheduler import SchedulerConfig
from deepinfer_core.errors import DeepInferError
from deepinfer_core.model.config import DeepseekConfig
from deepinfer_core.model.deepseek_v3 import DeepseekV3Model
from deepinfer_core.sampling.params import SamplingParams


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
        sync(self.device)
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
            "ms_per_step_p90": 1e3 * percentile(decode, 0.9),
            "tokens_per_s": batch / mid,
            "decode_steps": len(decode),
            "prefill_steps": sum(1 for _, prompt_tokens, _ in steps if prompt_tokens),
            "prefill_ms": 1e3 * sum(s for s, prompt_tokens, _ in steps if prompt_tokens),
            "prefix_cached_tokens": cached,
            "step_ms": [round(1e3 * s, 3) for s in decode],  # in order: a slow stretch shows (see "gpu")
            "gpu": gpu_state(self.device),
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


def report_header(argv: list[str] | None, dev: dict, entry, backend, dtype: torch.dtype) -> dict:
    """The fields every gpu_decode report opens with: when, the command, the machine, versions, the backend."""
    return {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "bench/gpu_decode.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {**machine(), "device": dev},
        "versions": {**versions(), **extra_versions()},
        "backend": None
        if backend is None
        else {
            "name": entry.name,
            "device": backend.device.name,
            "dtype": str(dtype).removeprefix("torch."),
            "block_size": backend.kv_layout.block_size,
            "capabilities": backend.capabilities.as_dict(),
        },
    }


def select_device(args, dtype: torch.dtype, what: str):
    """-> (torch device, backend entry or None, resolved backend or None); exits, saying why, where a full-size
    run (`what`) would land on the CPU."""
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
            f"{what} needs a GPU, but {where}: pass --accelerator with a GPU backend, "
            "--skip-ours for the transformers baseline and bounds alone, or --tiny for a CPU smoke run"
        )
    return device, entry, backend


def engine_config(args, block: int, **extra) -> EngineConfig:
    """KV blocks for the largest workload of `args` and a scheduler that takes every prompt of a batch in one step."""
    (n_prefill, prefill_len), max_batch = args.prefill, max(args.batches)
    blocks = max_batch + max(
        max_batch * -(-(args.prompt_len + args.new_tokens) // block), n_prefill * -(-(prefill_len + 1) // block)
    )
    scheduler = SchedulerConfig(
        max_num_seqs=max(256, max_batch),
        max_num_batched_tokens=max(16384, max_batch * args.prompt_len, n_prefill * prefill_len),
    )
    return EngineConfig(num_kv_blocks=blocks, scheduler=scheduler, **extra)


def run_workload(args, systems: dict, hf, vocab: int, device) -> tuple[dict, dict, list | None]:
    """Decode at every batch (ours; transformers at args.hf_batches), prefill, the profiles of those of ours chosen
    -> (decode {system: {batch: result}}, prefill {system: result}, profiles or None)."""
    decode = {key: {} for key in [*systems, *(["hf"] if hf else [])]}
    for b in args.batches:
        prompts = make_prompts(b, args.prompt_len, vocab, args.seed * 1000 + b)
        warmup = make_prompts(b, args.prompt_len, vocab, args.seed * 1000 + 500 + b)
        for key, system in systems.items():
            decode[key][str(b)] = system.decode(prompts, warmup, args.new_tokens)
            print(f"{key} batch {b}: {decode[key][str(b)]['ms_per_step']:.2f} ms/step", flush=True)
        if hf is not None and b in args.hf_batches:
            decode["hf"][str(b)] = hf_decode(hf, prompts, args.new_tokens, device)
            print(f"hf batch {b}: {decode['hf'][str(b)]['ms_per_step']:.2f} ms/step", flush=True)
    n_prefill, prefill_len = args.prefill
    prefill_sets = [
        make_prompts(n_prefill, prefill_len, vocab, args.seed * 1000 + 900 + r) for r in range(1 + args.prefill_repeats)
    ]
    prefill = {key: system.prefill(prefill_sets) for key, system in systems.items()}
    if hf is not None:
        prefill["hf"] = hf_prefill(hf, prefill_sets, device)
    profiles = None
    chosen = getattr(args, "profile_system", ["ours_default"])
    if args.profile:
        profiles = []
        for name in [chosen] if isinstance(chosen, str) else chosen:
            if name not in systems:
                profiles.append({"system": name, "skipped": f"{name} was not measured (the report's systems say why)"})
                continue
            for b in args.profile_batches:
                prompts = make_prompts(b, args.prompt_len, vocab, args.seed * 1000 + 700 + b)
                profiles.append({"system": name, **systems[name].profile(prompts, 5)})
    return decode, prefill, profiles


def workload_report(args, config: EngineConfig, block: int) -> dict:
    scheduler = config.scheduler
    return {
        "batches": args.batches,
        "hf_batches": args.hf_batches,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "prefill": list(args.prefill),
        "prefill_repeats": args.prefill_repeats,
        "greedy": True,
        "ignore_eos": True,
        "prompts": "uniform random ids in [8, vocab); the same prompts for every system at a batch",
        "seed": args.seed,
        "engine": {
            "num_kv_blocks": config.num_kv_blocks,
            "block_size": block,
            "max_num_seqs": scheduler.max_num_seqs,
            "max_num_batched_tokens": scheduler.max_num_batched_tokens,
            "step_budget_s": scheduler.step_budget_s,
        },
        "method": "ours: every engine.step() timed with the device synchronised before and after; decode "
        "steps = steps with no prompt tokens and all B sequences (median, p90); an untimed 4-token run at "
        "each batch first. transformers: (generate(N) - min of 2 generate(1)) / (N - 1) after a "
        "generate(2) warm-up. prefill: median over repeats after one untimed warm-up at the same shape.",
    }


def hf_decode(model, prompts, new: int, device) -> dict:
    """ms per decode step of transformers' generate: (generate(new) - generate(1)) / (new - 1)."""
    ids = torch.tensor(prompts, device=device)

    def generate(n: int):
        sync(device)
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
        sync(device)
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
        sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
        sync(device)
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
    match = token_match(ours, hf_decode(hf, prompts, 16, device)["tokens"])
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


def fp8_backend(entry, dtype):
    """-> (a backend of its own for the FP8 model, None), or (None, why not)."""
    if "fp8_block" not in entry.capabilities.weight_formats:
        formats = ", ".join(entry.capabilities.weight_formats) or "none"
        return None, (
            f"FP8 weights unavailable: backend {entry.name} does not take FP8 block-quantized weights "
            f"(capabilities.weight_formats: {formats}); a loader dequantizes them for it"
        )
    return resolve_backend(entry, dtype=dtype), None


def fp8_agreement_check(entry, seed: int) -> dict:
    """TINY_FP8_CONFIG, same random weights quantized to BlockFP8: the model holding them FP8 vs the model
    loaded dequantized (W x scale), greedy tokens compared, on `entry` where it takes the fp8_block format;
    else on a copy of the cpu backend declaring it (its reference ops dequantize on the fly: identical tokens)."""
    native = "fp8_block" in entry.capabilities.weight_formats
    if not native:
        entry = select_backend(discover(), "cpu")
    dtype = torch.float32 if "float32" in entry.capabilities.dtypes else torch.bfloat16
    backend = resolve_backend(entry, dtype=dtype)
    device, capable = backend.torch_device, backend
    if not native:
        formats = dataclasses.replace(backend.capabilities, weight_formats=("fp8_block",))
        capable = dataclasses.replace(backend, capabilities=formats)
    cfg = DeepseekConfig.from_hf(_gpu.TINY_FP8_CONFIG)
    quantized = _gpu.quantize_fp8(_gpu.random_weights(cfg, device, dtype, seed))
    fp8_model = DeepseekV3Model(cfg, quantized, capable)
    reference = DeepseekV3Model(cfg, _gpu.dequantized(quantized, dtype), backend)
    prompts = make_prompts(4, 16, cfg.vocab_size, seed + 7)
    runs = ((fp8_model, capable), (reference, backend))
    tokens = [Ours(m, b, EngineConfig(num_kv_blocks=64)).run(prompts, 16)[1] for m, b in runs]
    match = token_match(*tokens)
    return {
        "check": "TINY_FP8_CONFIG of bench/_gpu.py (every FP8 weight stays FP8), random weights quantized with "
        "BlockFP8.quantize, 4 prompts x 16 ids, 16 greedy tokens: the model holding BlockFP8 weights vs the "
        "same model loaded dequantized",
        "backend": f"{entry.name}, the chosen backend (its own FP8 kernels)"
        if native
        else f"a copy of {entry.name} declaring weight_formats=('fp8_block',) (the chosen backend lacks the "
        "format): its ops dequantize on the fly",
        "dtype": str(dtype).removeprefix("torch."),
        "fp8_held": _gpu.fp8_held(fp8_model),
        "exact_expected": not native,
        "fp8_agreement": match["identical_token_fraction"],
        "passed": match["identical_token_fraction"] == 1.0 if not native else None,
        **match,
    }
