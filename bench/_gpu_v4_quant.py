"""gpu_decode.py --model v4 | v41 --quantized: the same random weights in the formats DeepSeek releases them in.

Four more models of ours, each on a backend of its own, built from the benchmark's bf16 weights:
- ours_fp4_experts: routed experts MXFP4 (e2m1 pairs + E8M0 per 32, model/native_export.py's quantizer), the rest
  as ours_default holds it;
- ours_fp4_dequantized: the same model with those experts dequantized back to bf16 (what a loader gives a backend
  without the format): the "bf16 experts on the same model" both for speed and for greedy agreement;
- ours_fp8_projections: the projections DeepSeek ships in FP8 (attention's wq_a / wq_b / wkv / wo_b, the indexer's
  wq_b, shared experts) as FP8 with E8M0 scales in the release's blocks (V4 128 x 128, V4.1 32 x 32), experts bf16;
- ours_native: both, as the released checkpoint holds them.
The FP4 model's own decode bound counts its expert bytes (4.25 bits a weight) instead of bf16's.
"""

from __future__ import annotations

import torch
from _gpu_runners import Ours

from deepinfer_core.backend.resolve import resolve_backend
from deepinfer_core.backend.weight_formats import MXFP4, BlockFP8, dequantized, weight_bytes
from deepinfer_core.model.deepseek_v4 import QUANTIZED_WEIGHTS_V4

__all__ = [
    "MXFP4_BYTES_PER_WEIGHT",
    "expert_kernel_share",
    "fp4_sizes",
    "quant_backend",
    "quantized_systems",
    "quantized_summary",
]

FP4_EXPERTS = QUANTIZED_WEIGHTS_V4["mxfp4"]
FP8_KEPT = QUANTIZED_WEIGHTS_V4["fp8_block"]  # the weights a model keeps FP8; the routed experts among them go FP4
MXFP4_BYTES_PER_WEIGHT = 0.5 + 1 / 32  # a nibble, and one E8M0 byte per 32
EXPERT_KERNELS = ("_gate_up_kernel", "_down_kernel")  # kernels/moe.py's grouped GEMMs at decode sizes


def _fp8_projection(name: str) -> bool:
    return bool(FP8_KEPT.search(name)) and not FP4_EXPERTS.search(name)


def _quantize(weights: dict, chosen, quantize) -> dict:
    """`weights` with every name `chosen` picks replaced by quantize(w) (on w's device); the others the same tensors."""
    with torch.no_grad():
        return {name: quantize(w.float()) if chosen(name) else w for name, w in weights.items()}


def quant_backend(entry, dtype: torch.dtype):
    """-> (a backend of its own for a quantized model, None), or (None, why not)."""
    missing = [f for f in ("mxfp4", "fp8_block") if f not in entry.capabilities.weight_formats]
    if missing:
        return None, f"backend {entry.name} does not take {', '.join(missing)} weights (a loader dequantizes them)"
    return resolve_backend(entry, dtype=dtype), None


def quantized_systems(family, cfg, weights: dict, entry, dtype: torch.dtype, engine) -> tuple[dict, dict]:
    """-> ({system: Ours}, notes) for the three models above, or ({}, why not)."""
    first, reason = quant_backend(entry, dtype)
    if first is None:
        return {}, {"reason": reason}
    block = (128, 128) if family.name == "v4" else (32, 32)
    fp4 = _quantize(weights, FP4_EXPERTS.search, MXFP4.quantize)
    twin = {name: dequantized(w, dtype) for name, w in fp4.items()}
    fp8 = _quantize(weights, _fp8_projection, lambda w: BlockFP8.quantize(w, block, "e8m0"))
    native = {name: fp8[name] if _fp8_projection(name) else w for name, w in fp4.items()}
    systems, notes = {}, {"fp8_block": list(block), "weight_bytes_by_format": {}}
    held_by = {
        "ours_fp4_experts": fp4,
        "ours_fp4_dequantized": twin,
        "ours_fp8_projections": fp8,
        "ours_native": native,
    }
    for name, held in held_by.items():
        backend = first if not systems else quant_backend(entry, dtype)[0]  # a backend of its own for each
        notes["weight_bytes_by_format"][name] = weight_bytes(held.values())
        systems[name] = Ours(family.model(cfg, held, backend), backend, engine)
    notes["weight_bytes_by_format"]["ours_default"] = weight_bytes(weights.values())
    return systems, notes


def fp4_sizes(sizes: dict) -> dict:
    """bound.weight_sizes' result with the routed experts held MXFP4."""
    per_expert = sizes["params_per_expert"] * MXFP4_BYTES_PER_WEIGHT
    return {**sizes, "bytes_per_expert": per_expert, "weight_format": "routed experts mxfp4, the rest as held"}


def quantized_summary(decode: dict, token_match) -> dict:
    """Speed ratios and greedy agreement of the quantized models (before the tokens are dropped from `decode`)."""
    fp4, twin = decode.get("ours_fp4_experts", {}), decode.get("ours_fp4_dequantized", {})
    fp8, default = decode.get("ours_fp8_projections", {}), decode.get("ours_default", {})
    native = decode.get("ours_native", {})
    return {
        "native_speedup_vs_bf16": {
            b: default[b]["ms_per_step"] / r["ms_per_step"] for b, r in native.items() if b in default
        },  # fmt: skip
        "fp4_experts_speedup_vs_bf16_experts": {
            b: twin[b]["ms_per_step"] / r["ms_per_step"] for b, r in fp4.items() if b in twin
        },  # fmt: skip
        "fp8_projections_speedup_vs_bf16": {
            b: default[b]["ms_per_step"] / r["ms_per_step"] for b, r in fp8.items() if b in default
        },  # fmt: skip
        "token_match_fp4_vs_dequantized": {
            b: token_match(r["tokens"], twin[b]["tokens"]) for b, r in fp4.items() if b in twin
        },  # fmt: skip
        "targets": "FP4 experts >= 1.5x bf16 experts at batch 1 and 16, >= 0.4 of the FP4 model's own bound at 64; "
        "FP8 projections no slower than bf16 at any batch (issue #18)",
        "note": "token_match: greedy tokens of the timed runs of the FP4-held model and of the same values dequantized "
        "to bf16 (the dequantize-then-GEMM a loader gives other backends); identical where the kernels round as the "
        "reference does (dequantized tile in bf16, float32 accumulation)",
    }


def expert_kernel_share(report: dict) -> dict | None:
    """From --profile of ours_fp4_dequantized and ours_fp4_experts: how much of a decode step the routed experts'
    kernels take, and the speedup an FP4 expert kernel running AT its bytes' bound would give with the rest of the
    step as measured (Amdahl): twin step / (twin step - twin expert kernels + FP4 expert bytes / bandwidth)."""
    profiles = {(p["system"], p["batch"]): p for p in report.get("profile") or [] if "top" in p}
    sizes, bw = report["params"], report["measurements"]["copy_bandwidth"]["gb_per_s"] * 1e9
    fp4_per_expert = fp4_sizes(sizes)["bytes_per_expert"]
    rows = {}
    for (system, batch), twin in profiles.items():
        fp4 = profiles.get(("ours_fp4_experts", batch))
        if system != "ours_fp4_dequantized" or fp4 is None:
            continue

        def experts_ms(profile: dict) -> float:
            return sum(k["ms_per_step"] for k in profile["top"] if k["name"] in EXPERT_KERNELS)

        if not experts_ms(twin):  # a backend whose expert kernels are named otherwise (the cpu one's torch ops)
            continue
        touched = report["bound"]["decode"][str(batch)]["expected_experts_touched_per_layer"]
        fp4_bound = sizes["moe_layers"] * touched * fp4_per_expert / bw * 1e3
        twin_experts, fp4_experts = experts_ms(twin), experts_ms(fp4)
        rest = twin["total_ms_per_step"] - twin_experts
        own = report["bound"].get("decode_fp4_experts", {}).get(str(batch), {}).get("bound_ms")
        bf16_bound = report["bound"]["decode"][str(batch)]["bound_ms"]
        rows[str(batch)] = {
            "bf16_step_device_ms": twin["total_ms_per_step"],
            "bf16_expert_kernels_ms": twin_experts,
            "expert_share_of_bf16_step": twin_experts / twin["total_ms_per_step"],
            "fp4_step_device_ms": fp4["total_ms_per_step"],
            "fp4_expert_kernels_ms": fp4_experts,
            "fp4_expert_kernel_speedup": twin_experts / fp4_experts if fp4_experts else None,
            "fp4_expert_bytes_bound_ms": fp4_bound,
            "fp4_expert_kernels_fraction_of_bound": fp4_bound / fp4_experts if fp4_experts else None,
            "attainable_speedup_with_fp4_experts_at_bound": twin["total_ms_per_step"] / (rest + fp4_bound),
            "attainable_fraction_of_own_bound": own / (rest + fp4_bound) if own else None,
            "speedup_with_every_kernel_at_bound": bf16_bound / own if own else None,
        }
    if not rows:
        return None
    return {
        "note": "device time per decode step from torch.profiler (5 steps); expert kernels: "
        + ", ".join(EXPERT_KERNELS)
        + "; attainable_*: with the rest of the step as the bf16-expert model spends it and the FP4 expert kernels "
        "at their bytes' bound (expected touched experts x MXFP4 bytes / copy bandwidth): what no FP4 expert kernel "
        "alone can exceed; speedup_with_every_kernel_at_bound: the bf16-expert model's decode bound over the FP4 "
        "model's (both models entirely at the hardware bound)",
        "by_batch": rows,
    }
