"""Decode and prefill speed on one GPU: DeepInfer (default, batch-invariant, FP8 weights) vs transformers, vs the bound.

One run, side by side on the same random bf16 weights (DESIGN.md §7), DeepSeek-V2-Lite dimensions written
as a DeepSeek-V3 config (27 layers, hidden 2048, MLA kv_lora 512, 64 routed experts top-6 + 2 shared):

1. weights are generated on the device in our checkpoint naming; our model is built from them and
   transformers' DeepseekV3ForCausalLM gets the same tensors assigned (fused experts shared, no copy);
   where the backend takes FP8 block-quantized weights, a third model of ours holds the same weights
   quantized (ops.BlockFP8, every FP8_WEIGHTS match);
2. decode: B prompts of 128 random ids, N (64) greedy tokens, EOS ignored, at B = 1, 16, 64, 256; every
   engine step timed, decode steps (no prompt tokens, all B sequences) summarised as ms/step and tok/s;
   transformers: (generate N tokens - generate 1 token) / (N - 1);
3. prefill: 16 x 1024 tokens, tokens/s and TFLOP/s;
4. bounds: bytes read per decode step over measured copy bandwidth (FP8 weights: their own bytes), flops
   over measured GEMM peak;
5. greedy-agreement checks on tiny configs: ours vs transformers (float32, identical tokens expected), and
   FP8 weights vs the same weights dequantized.

`--model v4` / `--model v41` (bench/_gpu_v4_run.py): DeepSeek-V4 at V4-Flash width (4 layers: sliding, CSA,
HCA, CSA; 32 experts) against transformers' DeepseekV4ForCausalLM on the same weights, or DeepSeek-V4.1 at its
released width (5 layers, 32 experts; transformers has no V4.1), each against a bound counting the cache bytes
the model's cache_specs say a decode step reads; the default mode of ours only.

Run: python bench/gpu_decode.py            (on a GPU; --tiny for a CPU smoke run)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # run as a script: bench/ holds its helpers
import _gpu  # noqa: E402
import _gpu_measure as measure  # noqa: E402
import _gpu_v4_run  # noqa: E402
from _gpu_report import print_table, summarise, write_plot  # noqa: E402
from _gpu_runners import (  # noqa: E402
    Ours,
    agreement_check,
    batch_invariant_backend,
    engine_config,
    fp8_agreement_check,
    fp8_backend,
    report_header,
    run_workload,
    select_device,
    workload_report,
)

from deepinfer_core.model.config import DeepseekConfig  # noqa: E402
from deepinfer_core.model.deepseek_v3 import DeepseekV3Model  # noqa: E402

PROFILED = ("ours_default", "ours_batch_invariant", "ours_fp4_experts", "ours_fp4_dequantized", "ours_fp8_projections",
            "ours_native")  # fmt: skip


def profiled_systems(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    unknown = [x for x in names if x not in PROFILED]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown system(s) {', '.join(unknown) or '(none)'}; pick from {PROFILED}")
    return names


def parse_args(argv):
    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",") if x]

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--model",
        choices=("v3", "v4", "v41"),
        default="v3",
        help="v3: V2-Lite dimensions as DeepSeek-V3; v4: DeepSeek-V4 at V4-Flash width, 4 layers, 32 experts; "
        "v41: DeepSeek-V4.1 at its released width, 5 layers, 32 experts (no transformers baseline)",
    )
    p.add_argument("--accelerator", default="auto", help="backend name or alias, or auto")
    p.add_argument("--tiny", action="store_true", help="tiny float32 config and workload: a CPU smoke run")
    p.add_argument("--batches", type=ints, help="decode batch sizes (default 1,16,64,256; tiny 1,4)")
    p.add_argument("--new-tokens", type=int, help="tokens generated per sequence (default 64; v4, v41 33; tiny 6)")
    p.add_argument("--prompt-len", type=int, help="decode prompt length (default 128; tiny 16)")
    p.add_argument("--prefill", type=ints, help="prefill prompts,length (default 16,1024; v4, v41 8,1024; tiny 4,64)")
    p.add_argument("--prefill-repeats", type=int, default=3)
    p.add_argument("--hf-batches", type=ints, help="batches run with transformers (default: those <= 64)")
    p.add_argument("--skip-hf-batches", type=ints, default=[], help="leave these batches out of the transformers runs")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-ours", action="store_true", help="transformers and bounds only (no DeepInfer GPU backend)")
    p.add_argument("--skip-batch-invariant", action="store_true")
    p.add_argument(
        "--fp8",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure a model of ours holding the weights FP8 block-quantized (ops.BlockFP8), where the "
        "backend declares the fp8_block weight format (skipped with the reason otherwise)",
    )
    p.add_argument(
        "--quantized",
        action="store_true",
        help="--model v4 / v41: also models of ours holding the routed experts FP4 (MXFP4), the same experts "
        "dequantized, and the projections FP8 with E8M0 scales (bench/_gpu_v4_quant.py)",
    )
    p.add_argument("--profile", action="store_true", help="torch.profiler: top 25 kernels of our decode steps")
    p.add_argument("--profile-batches", type=ints, help="default 1,64 (tiny 1,4)")
    p.add_argument(
        "--profile-system", default="ours_default", type=profiled_systems,
        help="which of our systems --profile profiles, comma-separated: " + ", ".join(PROFILED) + " (the quantized "
        "ones with --quantized)",
    )  # fmt: skip
    p.add_argument("--copy-mib", type=int, help="buffer of the copy-bandwidth measurement (default 2048; tiny 16)")
    p.add_argument("--gemm-size", type=int, help="n of the n^3 GEMM peak measurement (default 8192; tiny 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out", type=Path, help="default bench/results/gpu_decode_<device>.json (v4, v41: gpu_decode_<model>_<device>)"
    )
    p.add_argument("--plot", type=Path, help="default: --out with .png")
    args = p.parse_args(argv)
    tiny, v3 = args.tiny, args.model == "v3"
    defaults = {
        "batches": [1, 4] if tiny else [1, 16, 64, 256],
        "new_tokens": 6 if tiny else 64 if v3 else 33,
        "prompt_len": 16 if tiny else 128,
        "prefill": [4, 64] if tiny else [16, 1024] if v3 else [8, 1024],
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
    device, entry, backend = select_device(args, dtype, "the V2-Lite-sized model")
    return raw, DeepseekConfig.from_hf(raw), dtype, device, entry, backend


def build_models(args, cfg, dtype, device, entry, backend) -> tuple[dict, object, dict, dict]:
    """Ours (default, batch-invariant, FP8) and transformers on one set of weights -> (models, hf, build seconds,
    {mode: why it is not measured, or None} + the FP8 model's held tensors). Peak: ~2 copies of the weights (ours
    stacks its experts; the per-expert originals are then freed), steady: ~1 + 1 per extra mode (FP8: ~1/2)."""
    t0 = time.perf_counter()
    weights = _gpu.random_weights(cfg, device, dtype, args.seed)
    models, stacks, seconds = {}, {}, {"weights": time.perf_counter() - t0}
    notes = {"batch_invariant": None, "fp8": "no model of ours (--skip-ours)"}
    if backend is not None:
        t0 = time.perf_counter()
        models["ours_default"] = (DeepseekV3Model(cfg, weights, backend), backend)
        seconds["ours_default"] = time.perf_counter() - t0
        stacks = _gpu.fused_experts(models["ours_default"][0])
        _gpu.share_expert_storage(weights, cfg, stacks)
        if args.skip_batch_invariant:
            bi, notes["batch_invariant"] = None, "skipped (--skip-batch-invariant)"
        else:
            bi, notes["batch_invariant"] = batch_invariant_backend(entry, dtype)
        if bi is not None:
            t0 = time.perf_counter()
            models["ours_batch_invariant"] = (DeepseekV3Model(cfg, weights, bi), bi)
            seconds["ours_batch_invariant"] = time.perf_counter() - t0
        fp8, notes["fp8"] = fp8_backend(entry, dtype) if args.fp8 else (None, "skipped (--no-fp8)")
        if fp8 is not None:
            t0 = time.perf_counter()
            quantized = _gpu.quantize_fp8(weights)  # on the device; unquantized entries are the same tensors
            seconds["fp8_quantize"], t0 = time.perf_counter() - t0, time.perf_counter()
            models["ours_fp8"] = (DeepseekV3Model(cfg, quantized, fp8), fp8)
            del quantized  # the per-expert FP8 tensors: the model holds its own stacks
            seconds["ours_fp8"] = time.perf_counter() - t0
            notes["fp8_held"] = _gpu.fp8_held(models["ours_fp8"][0])
    hf = None
    if not args.skip_hf:
        t0 = time.perf_counter()
        hf = _gpu.hf_model(args.raw_config, _gpu.hf_state_dict(weights, cfg, stacks), device)
        seconds["hf"] = time.perf_counter() - t0
    return models, hf, seconds, notes


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model != "v3":
        return _gpu_v4_run.main(args, argv)
    started = time.perf_counter()
    raw, cfg, dtype, device, entry, backend = build(args)
    args.raw_config = raw
    dev = measure.device_info(device)
    name = dev.get("gpu_name", device.type)
    out = args.out or Path(f"bench/results/gpu_decode_{re.sub(r'[^a-z0-9]+', '_', name.lower()).strip('_')}.json")
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:
        args.skip_hf = True
    print(f"device {name}, backend {entry.name if entry else '-'}, {str(dtype).removeprefix('torch.')}", flush=True)

    copy = measure.measure_copy_bandwidth(device, args.copy_mib)
    gemm = measure.measure_gemm(device, dtype, args.gemm_size)
    agreement = fp8_agreement = None
    if entry is not None and not args.skip_hf:
        agreement = agreement_check(entry, device, args.seed)
        print(f"greedy agreement with transformers (tiny float32): {agreement['hf_agreement']:.3f}", flush=True)
    if entry is not None and args.fp8:
        fp8_agreement = run_fp8_agreement(entry, args.seed)
    models, hf, build_seconds, notes = build_models(args, cfg, dtype, device, entry, backend)

    block = backend.kv_layout.block_size if backend else 1
    engine = engine_config(args, block)
    systems = {key: Ours(m, b, engine) for key, (m, b) in models.items()}
    decode, prefill, profiles = run_workload(args, systems, hf, cfg.vocab_size, device)

    report_sizes, fp8_sizes = measure.model_sizes(cfg, dtype), measure.model_sizes(cfg, dtype, fp8=True)
    report = {
        "benchmark": "gpu_decode",
        **report_header(argv, dev, entry, backend, dtype),
        "batch_invariant": {"measured": "ours_batch_invariant" in systems, "reason": notes["batch_invariant"]},
        "fp8": {
            "measured": "ours_fp8" in systems,
            "reason": notes["fp8"],
            "weights": "the benchmark's random weights, every FP8_WEIGHTS match (deepinfer_core.model.deepseek_v3) "
            "replaced by BlockFP8.quantize(w) on the device (float8_e4m3fn, float32 scale = amax / 448 per "
            "[128, 128] block); the others shared with ours_default; its own backend instance",
            "params": fp8_sizes,
            "weight_bytes_over_default": fp8_sizes["bytes_total"] / report_sizes["bytes_total"],
            "dequantized_gate_up": measure.fp8_dequantized_gate_up(cfg),
            "held": notes.get("fp8_held"),
        },
        "hf": None
        if hf is None
        else {
            "attn_implementation": hf.config._attn_implementation,
            "experts_implementation": getattr(hf.config, "_experts_implementation", None),
        },
        "config": raw,
        "params": report_sizes,
        "workload": workload_report(args, engine, block),
        "measurements": {"copy_bandwidth": copy, "gemm": gemm, "build_seconds": build_seconds},
        "decode": decode,
        "prefill": prefill,
        "hf_agreement": agreement,
        "fp8_agreement": fp8_agreement,
        "profile": profiles,
    }
    summarise(report, cfg, dtype)
    if device.type == "cuda":
        report["measurements"]["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    title = f"{cfg.num_hidden_layers}-layer DeepSeek MoE, {str(dtype).removeprefix('torch.')}, {name}"
    plot = args.plot or out.with_suffix(".png")
    report["plot"] = write_plot(plot, decode, report["bound"]["decode"], title, report["bound"]["decode_fp8"])
    report["wall_seconds"] = time.perf_counter() - started
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print_table(report)
    print(f"\nwrote {out} ({report['wall_seconds']:.0f} s)")
    return 0


def run_fp8_agreement(entry, seed: int) -> dict:
    """fp8_agreement_check; on a backend with its own FP8 kernels a failure is recorded, not fatal."""
    try:
        check = fp8_agreement_check(entry, seed)
    except Exception as err:  # the benchmark itself can still run
        if "fp8_block" not in entry.capabilities.weight_formats:
            raise
        check = {"error": f"{type(err).__name__}: {err}", "passed": False}
        print(f"FP8 agreement check failed: {check['error']}", flush=True)
        return check
    print(f"greedy agreement, FP8 weights vs dequantized (tiny): {check['fp8_agreement']:.3f}", flush=True)
    return check


if __name__ == "__main__":
    sys.exit(main())
