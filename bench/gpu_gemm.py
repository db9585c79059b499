"""The batch-invariant mode's dense GEMM (kernels/gemm.py: one fixed tiling per dtype, K splits chosen from the
weight's shape alone) against cuBLAS (torch's F.linear, what the default mode runs) and the weight-read bound,
at DeepSeek-V4.1 Flash's projection shapes and a range of row counts, in one run: which fixed tiling would bring
the batch-invariant mode nearest the default one (issue #16).

    python bench/gpu_gemm.py --out bench/results/gpu_gemm_nvidia_h200.json

Each tiling is batch-invariant (none depends on M); `current` is production's. --tiny: small shapes under
Triton's interpreter (a CPU smoke run; its times mean nothing).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

if "--tiny" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, versions  # noqa: E402
from _gpu_measure import device_info, measure_copy_bandwidth, replayed_ms  # noqa: E402

from deepinfer_nvidia_sm100.kernels import gemm  # noqa: E402

# (name, N, K): V4.1 Flash's dense projections (hidden 5120, q_lora 1280, 64 heads x 512, o_groups 8 x 1024,
# index 32 heads x 128, shared expert 2304)
SHAPES = [
    ("q_a", 1280, 5120),
    ("q_b", 32768, 1280),
    ("kv", 512, 5120),
    ("o_b", 5120, 8192),
    ("index_q", 4096, 1280),
    ("shared_gate_up", 4608, 5120),
    ("shared_down", 5120, 2304),
]
TINY_SHAPES = [("a", 64, 96), ("b", 96, 64)]
# name: (BM, BN, BK, warps) or None (production's), waves, stages, max K splits or None (production's)
TILINGS = {
    "current": (None, 1, 3, None),
    "waves2": (None, 2, 3, None),
    "waves3": (None, 3, 3, None),
    "bn128_waves2": ((64, 128, 64, 4), 2, 3, None),
    "bk128_waves2": ((64, 64, 128, 4), 2, 4, None),
    "bm128_bn128_w8": ((128, 128, 64, 8), 1, 3, None),
}
# --model-calls' float32 calls (routers, mixers, compressor gates): production's, and the tiling before it
F32_TILINGS = {
    "current": (None, 1, 3, None),
    "bm64_bn64_8splits": ((64, 64, 32, 4), 1, 3, 8),
    "bm16": ((16, 32, 32, 4), 1, 3, None),
    "bm64_bn32": ((64, 32, 32, 4), 1, 3, None),
    "bm32_w2": ((32, 32, 32, 2), 1, 3, None),
}
TINY_TILINGS = {"current": (None, 1, 3, None), "bm16": ((16, 32, 32, 4), 2, 3, None)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes under the interpreter: a CPU smoke run")
    parser.add_argument("--rows", default=None, help="row counts M (default 1,16,64,256,2048; tiny 1,5)")
    parser.add_argument("--model-calls", choices=("v4", "v41"), default=None,
                        help="instead of the shapes above: every GEMM call of one batch-invariant decode step of "
                        "gpu_decode.py's model, each timed alone against cuBLAS")  # fmt: skip
    parser.add_argument("--model-batches", default="1,64", help="decode batches of --model-calls")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.model_calls:
        return model_calls(args, argv)
    device = torch.device("cpu" if args.tiny else "cuda")
    shapes, tilings = (TINY_SHAPES, TINY_TILINGS) if args.tiny else (SHAPES, TILINGS)
    rows_list = [int(m) for m in (args.rows or ("1,5" if args.tiny else "1,16,64,256,2048")).split(",")]
    repeats, inner = (1, 1) if args.tiny else (7, 20)
    bandwidth = measure_copy_bandwidth(device, 16 if args.tiny else 2048)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    results = []
    for name, n, k in shapes:
        weight = (torch.randn(n, k, generator=g, device=device) * k**-0.5).to(dtype)
        bound_ms = n * k * weight.element_size() / (bandwidth["gb_per_s"] * 1e9) * 1e3
        for m in rows_list:
            x = torch.randn(m, k, generator=g, device=device).to(dtype)
            row = {"shape": name, "n": n, "k": k, "m": m, "weight_bound_ms": bound_ms}
            row["cublas_ms"] = replayed_ms(functools.partial(F.linear, x, weight), device, repeats, inner)
            reference = None
            for tiling, (tiles, waves, stages, max_splits) in tilings.items():
                call = functools.partial(gemm.batched_matmul, x[None], weight[None], tiles=tiles, waves=waves,
                                         stages=stages, max_splits=max_splits)  # fmt: skip
                out = call()[0]
                reference = out if reference is None else reference
                row[f"{tiling}_ms"] = replayed_ms(call, device, repeats, inner)
                row[f"{tiling}_max_abs_vs_current"] = float((out.float() - reference.float()).abs().max())
            results.append(row)
            print(json.dumps({k_: round(v, 4) if isinstance(v, float) else v for k_, v in row.items()}), flush=True)
    report = {
        "benchmark": "gpu_gemm",
        "command": " ".join(["python", "bench/gpu_gemm.py", *(argv if argv is not None else sys.argv[1:])]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {**machine(), "device": device_info(device)},
        "versions": versions(),
        "dtype": str(dtype),
        "tilings": _tilings_report(tilings),
        "method": f"median of {repeats} timings of {inner} calls replayed as one CUDA graph (on a GPU), device "
        "synchronised around each; "
        "weight_bound_ms = the weight's bytes / copy bandwidth (activations not counted)",
        "copy_bandwidth": bandwidth,
        "rows": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _tilings_report(tilings: dict) -> dict:
    return {
        name: {"tiles_bm_bn_bk_warps": t, "waves": w, "stages": s, "max_splits": m}
        for name, (t, w, s, m) in tilings.items()
    }


def _record_step_calls(model_name: str, batch: int, dtype: torch.dtype):
    """-> (every batched_matmul call of one eager decode step of gpu_decode.py's `model_name` in batch-invariant
    mode at `batch` sequences, as (a, b, bias, b_scale), the backend entry)."""
    import _gpu_v4 as models
    from _gpu_runners import Ours, engine_config, make_prompts

    from deepinfer_core.backend.registry import discover
    from deepinfer_core.backend.resolve import resolve_backend
    from deepinfer_core.backend.selection import select_backend

    entry = select_backend(discover(), "nvidia")
    backend = resolve_backend(entry, dtype=dtype, batch_invariant=True)
    family = models.FAMILIES[model_name]
    cfg = family.parse(models.CONFIGS[model_name][0])
    weights = models.random_weights(family, cfg, backend.torch_device, dtype, 0)
    model, _ = models.build_ours(family, cfg, weights, backend)
    shape = argparse.Namespace(prefill=(1, 128), batches=[batch], prompt_len=128, new_tokens=4)
    config = engine_config(shape, backend.kv_layout.block_size, window_snapshot_bytes=0, graph_batch_size=0)
    calls, recording, original = [], [False], gemm.batched_matmul

    def recorder(a, b, bias=None, b_scale=None, **kwargs):
        if recording[0]:
            calls.append((a.clone(), b, bias, b_scale))
        return original(a, b, bias, b_scale, **kwargs)

    def before_step(i: int) -> None:  # call 0 launches the prompt step, call 1 the first decode step, ...
        recording[0] = i == 2

    gemm.batched_matmul = recorder
    try:
        Ours(model, backend, config).run(make_prompts(batch, 128, cfg.vocab_size, batch), 4, before_step)
    finally:
        gemm.batched_matmul = original
    return calls, entry


def model_calls(args, argv: list[str] | None) -> int:
    """--model-calls: where the batch-invariant mode's GEMM time goes, call by call, against cuBLAS."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    results, entry = [], None
    for batch in [int(b) for b in args.model_batches.split(",")]:
        calls, entry = _record_step_calls(args.model_calls, batch, dtype)
        groups: dict[tuple, list] = {}
        for a, b, bias, b_scale in calls:
            key = (tuple(a.shape), tuple(b.shape), str(a.dtype), a.stride(), bias is not None, b_scale is not None)
            groups.setdefault(key, [a, b, bias, b_scale, 0])[4] += 1
        for (a_shape, b_shape, a_dtype, _, has_bias, fp8), (a, b, bias, b_scale, count) in groups.items():
            candidates = F32_TILINGS if a.dtype == torch.float32 else TILINGS
            if fp8:
                library = None
            elif a.shape[0] == 1:
                library = functools.partial(F.linear, a[0], b[0], bias)
            else:
                library = functools.partial(torch.baddbmm if has_bias else torch.bmm, *((bias,) if has_bias else ()),
                                            a, b.transpose(1, 2))  # fmt: skip
            row = {
                "batch": batch, "groups": a_shape[0], "m": a_shape[1], "k": a_shape[2], "n": b_shape[1],
                "dtype": a_dtype, "a_contiguous": a.is_contiguous(), "bias": has_bias, "fp8_weight": fp8,
                "calls_per_step": count, "splits": gemm.split_count(b_shape[1], a_shape[2], a.dtype),
                "cublas_ms": replayed_ms(library, device, 7, 20) if library is not None else None,
            }  # fmt: skip
            for name, (tiles, waves, stages, max_splits) in candidates.items():
                call = functools.partial(gemm.batched_matmul, a, b, bias, b_scale, tiles=tiles, waves=waves,
                                         stages=stages, max_splits=max_splits)  # fmt: skip
                row[f"{name}_ms"] = replayed_ms(call, device, 7, 20)
            row["ours_ms"] = row["current_ms"]
            results.append(row)
            print(json.dumps({k_: round(v, 4) if isinstance(v, float) else v for k_, v in row.items()}), flush=True)
        total = {key: sum(r[key] * r["calls_per_step"] for r in results if r["batch"] == batch and r[key] is not None)
                 for key in ("ours_ms", "cublas_ms")}  # fmt: skip
        ours_ms, cublas_ms = total["ours_ms"], total["cublas_ms"]
        print(f"batch {batch}: {len(calls)} calls a step, ours {ours_ms:.3f} ms, cuBLAS {cublas_ms:.3f} ms", flush=True)
    report = {
        "benchmark": "gpu_gemm --model-calls",
        "model": args.model_calls,
        "backend": entry.name if entry else None,
        "command": " ".join(["python", "bench/gpu_gemm.py", *(argv if argv is not None else sys.argv[1:])]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {**machine(), "device": device_info(device)},
        "versions": versions(),
        "tilings": {"bfloat16": _tilings_report(TILINGS), "float32": _tilings_report(F32_TILINGS)},
        "method": "one eager decode step of gpu_decode.py's model in batch-invariant mode records every "
        "kernels/gemm.batched_matmul call (its inputs); each distinct call is then timed alone, ours and cuBLAS "
        "(F.linear / bmm on the same operands), median of 7 timings of 20 calls replayed as one CUDA graph",
        "rows": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
