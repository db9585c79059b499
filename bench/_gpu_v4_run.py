"""gpu_decode.py --model v4 | v41: DeepSeek-V4 (vs transformers' DeepseekV4ForCausalLM on the same weights) or
DeepSeek-V4.1 (no transformers baseline), decode and prefill vs the bound, one run, JSON naming the machine.

The workload and the timing are V3's (run_workload, bench/_gpu_runners.py); the bounds count the bytes a
decode step reads from the model's own cache declarations (bench/_gpu_v4_bound.py). Ours in its default mode
and, where the backend runs the model batch-invariantly (it does not list "v4_batch_invariance" unsupported),
in batch-invariant mode on the same weights; the FP8-weight model is V3's so far (recorded as not measured).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import _gpu_measure as measure
import _gpu_v4 as models
import _gpu_v4_bound as bound
import _gpu_v4_quant as quant
import torch
from _gpu_report import write_plot
from _gpu_runners import (
    Ours,
    batch_invariant_backend,
    engine_config,
    hf_decode,
    make_prompts,
    report_header,
    run_workload,
    select_device,
    workload_report,
)

from deepinfer_core.backend.resolve import resolve_backend
from deepinfer_core.engine.engine import EngineConfig

NOT_MEASURED = "not measured for --model {model}: gpu_decode.py measures FP8 weights on the V3 model only so far"


def main(args, argv: list[str] | None) -> int:
    started = time.perf_counter()
    family = models.FAMILIES[args.model]
    raw = models.CONFIGS[args.model][1 if args.tiny else 0]
    cfg = family.parse(raw)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    width = "tiny" if args.tiny else f"hidden {cfg.hidden_size}"
    device, entry, backend = select_device(args, dtype, f"{family.title} at {width}")
    hf_reason = family.hf_unavailable or ("skipped (--skip-hf)" if args.skip_hf else None)
    if hf_reason is None:
        try:
            import transformers

            transformers.logging.set_verbosity_error()
        except ImportError:
            hf_reason = "transformers is not installed"
    dev = measure.device_info(device)
    name = dev.get("gpu_name", device.type)
    slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    out = args.out or Path(f"bench/results/gpu_decode_{args.model}_{slug}.json")
    print(f"{family.title}, device {name}, backend {entry.name if entry else '-'}, {_name(dtype)}", flush=True)

    copy = measure.measure_copy_bandwidth(device, args.copy_mib)
    gemm = measure.measure_gemm(device, dtype, args.gemm_size)
    agreement = None
    if entry is not None and hf_reason is None:
        agreement = agreement_check(entry, device, args.seed)
        print(f"greedy agreement with transformers (tiny float32): {agreement['hf_agreement']:.3f}", flush=True)

    seconds, t0 = {}, time.perf_counter()
    weights = models.random_weights(family, cfg, device, dtype, args.seed)
    seconds["weights"], t0 = time.perf_counter() - t0, time.perf_counter()
    model, stacks = models.build_ours(family, cfg, weights, backend) if backend else (None, {})
    if model is not None:
        seconds["ours_default"], t0 = time.perf_counter() - t0, time.perf_counter()
    bi, bi_reason = _batch_invariant_backend(args, entry, dtype)
    bi_model = models.build_ours(family, cfg, weights, bi)[0] if bi is not None else None
    if bi_model is not None:
        seconds["ours_batch_invariant"] = time.perf_counter() - t0
    block = backend.kv_layout.block_size if backend else 128
    engine = engine_config(args, block, window_snapshot_bytes=0)  # no host copies of windows: nothing hits
    quantized, quant_notes = {}, {"reason": "skipped (pass --quantized)"}
    if model is not None and args.quantized:
        t0 = time.perf_counter()
        quantized, quant_notes = quant.quantized_systems(family, cfg, weights, entry, dtype, engine)
        seconds["quantized_models"] = time.perf_counter() - t0
    hf = None
    if hf_reason is None:
        t0 = time.perf_counter()
        hf = models.hf_model(raw, models.hf_state_dict(weights, cfg, stacks), device, dtype)
        seconds["hf"] = time.perf_counter() - t0
    del weights  # the models hold what they read

    systems = {"ours_default": Ours(model, backend, engine)} if model is not None else {}
    if bi_model is not None:
        systems["ours_batch_invariant"] = Ours(bi_model, bi, engine)
    systems |= quantized
    decode, prefill, profiles = run_workload(args, systems, hf, cfg.vocab_size, device)
    quant_notes |= quant.quantized_summary(decode, measure.token_match) if quantized else {}

    specs, specs_from = _cache_specs(family, cfg, model, dtype)
    report = {
        "benchmark": "gpu_decode",
        "model": {
            "name": args.model,
            "title": family.title,
            "architecture": cfg.architecture,
            "layer_types": list(cfg.layer_types),
            **_schedule(family, cfg),
        },
        **report_header(argv, dev, entry, backend, dtype),
        "systems": {
            "ours_default": "DeepInfer's engine, default mode" if systems else "not measured (--skip-ours)",
            "ours_batch_invariant": "DeepInfer's engine, batch-invariant mode (resolve_backend(batch_invariant=True))"
            if bi_model is not None
            else f"not measured: {bi_reason}",
            "hf": "transformers' DeepseekV4ForCausalLM, eager, generate / forward" if hf else f"none: {hf_reason}",
        },
        "batch_invariant": {"measured": bi_model is not None, "reason": bi_reason},
        "fp8": {"measured": False, "reason": NOT_MEASURED.format(model=args.model)},
        "quantized": {"measured": bool(quantized), **quant_notes},
        "hf": {"available": False, "reason": hf_reason}
        if hf is None
        else {
            "available": True,
            "class": type(hf).__name__,
            "attn_implementation": hf.config._attn_implementation,
            "experts_implementation": getattr(hf.config, "_experts_implementation", None),
        },
        "config": raw,
        "params": bound.weight_sizes(family, cfg, dtype),
        "cache": bound.cache_report(specs, block, specs_from),
        "workload": {**workload_report(args, engine, block), "window_snapshot_bytes": 0},
        "measurements": {"copy_bandwidth": copy, "gemm": gemm, "build_seconds": seconds},
        "decode": decode,
        "prefill": prefill,
        "hf_agreement": agreement,
        "profile": profiles,
    }
    bound.summarise(report, family, cfg, specs)
    if "ours_fp4_experts" in decode:
        _fp4_bound(report, family, cfg, specs)
        report["quantized"]["expert_kernel_share"] = quant.expert_kernel_share(report)
    if device.type == "cuda":
        report["measurements"]["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    title = f"{family.title}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {_name(dtype)}, {name}"
    report["plot"] = write_plot(args.plot or out.with_suffix(".png"), decode, report["bound"]["decode"], title)
    report["wall_seconds"] = time.perf_counter() - started
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    bound.print_table(report)
    print(f"\nwrote {out} ({report['wall_seconds']:.0f} s)")
    return 0


def _fp4_bound(report: dict, family, cfg, specs) -> None:
    """The FP4-expert model against a bound counting its own expert bytes (fraction_of_own_bound)."""
    work, sizes = report["workload"], quant.fp4_sizes(report["params"])
    bw = report["measurements"]["copy_bandwidth"]["gb_per_s"] * 1e9
    peak = report["measurements"]["gemm"]["tflop_per_s"] * 1e12
    context = work["prompt_len"] + work["new_tokens"] / 2
    results = report["decode"]["ours_fp4_experts"]
    own = {b: bound.decode_step_bound(family, cfg, sizes, specs, int(b), context, bw, peak) for b in results}
    report["bound"]["decode_fp4_experts"] = own
    for b, r in results.items():
        r["fraction_of_own_bound"] = own[b]["bound_ms"] / r["ms_per_step"]


def _batch_invariant_backend(args, entry, dtype):
    """-> (the batch-invariant backend, None), or (None, why it is not measured)."""
    if entry is None or args.skip_ours:
        return None, "no model of ours (--skip-ours)"
    if args.skip_batch_invariant:
        return None, "skipped (--skip-batch-invariant)"
    caveat = entry.capabilities.supports("v4_batch_invariance")
    if caveat is not True:
        return None, f"backend {entry.name} does not run DeepSeek-V4 models batch-invariantly: {caveat}"
    return batch_invariant_backend(entry, dtype)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _schedule(family, cfg) -> dict:
    if family.name == "v4":
        return {"compress_rates": cfg.compress_rates, "mlp_layer_types": list(cfg.mlp_layer_types)}
    return {
        "compress_ratios": list(cfg.compress_ratios),
        "kv_source_layer_ids": list(cfg.kv_source_layer_ids),
        "index_source_layer_ids": list(cfg.index_source_layer_ids),
        "candidate_source_layer_id": cfg.candidate_source_layer_id,
        "engram_layer_ids": list(cfg.engram_layer_ids),
    }


def _cache_specs(family, cfg, model, dtype: torch.dtype) -> tuple[list, str]:
    """The model's cache declarations; without a model (--skip-ours) the same declarations built on meta
    tensors (bench/v41_cache_bytes.py)."""
    if model is not None:
        return model.cache_specs, "model.cache_specs"
    import v41_cache_bytes

    make = v41_cache_bytes.v4_cache_specs if family.name == "v4" else v41_cache_bytes.v41_cache_specs
    return make(cfg, dtype), "meta declarations (bench/v41_cache_bytes.py), no model built"


def agreement_check(entry, device, seed: int) -> dict:
    """V4_TINY in float32, same weights: our engine vs transformers' generate, greedy tokens compared."""
    family = models.FAMILIES["v4"]
    dtype = torch.float32 if "float32" in entry.capabilities.dtypes else torch.bfloat16
    backend = resolve_backend(entry, dtype=dtype)
    cfg = family.parse(models.V4_TINY)
    weights = models.random_weights(family, cfg, device, dtype, seed)
    model, stacks = models.build_ours(family, cfg, weights, backend)
    hf = models.hf_model(models.V4_TINY, models.hf_state_dict(weights, cfg, stacks), device, dtype)
    prompts = make_prompts(4, 16, cfg.vocab_size, seed + 7)
    ours = Ours(model, backend, EngineConfig(num_kv_blocks=64, window_snapshot_bytes=0)).run(prompts, 16)[1]
    match = measure.token_match(ours, hf_decode(hf, prompts, 16, device)["tokens"])
    return {
        "check": "V4_TINY of bench/_gpu_v4.py (sliding, CSA, HCA, CSA; window 8, rates 4 / 8; indexer top-k above "
        "the entry count), random weights, 4 prompts x 16 ids, 16 greedy tokens: our engine on the chosen backend "
        "vs transformers generate",
        "dtype": _name(dtype),
        "hf_agreement": match["identical_token_fraction"],
        "passed": match["identical_token_fraction"] == 1.0,
        **match,
    }
