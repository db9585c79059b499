"""Helpers of gpu_decode.py: configs, random weights on the device, the transformers twin, rates and bounds.

Device-agnostic: the device is whatever the chosen backend runs on; torch.cuda is touched only when
that device is a CUDA device (bench/ may name vendors, deepinfer_core/ may not).
"""

from __future__ import annotations

import importlib.metadata
import math
import time

import torch

from deepinfer_core.model.config import DeepseekConfig
from deepinfer_core.model.deepseek_v3 import FLOAT32_WEIGHTS, expected_weights

# DeepSeek-V2-Lite's dimensions, spelled as a DeepSeek-V3 config (V3 routing: sigmoid + bias, one group).
V2_LITE_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "first_k_dense_replace": 1,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "n_shared_experts": 2,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
TINY_CONFIG = {
    **V2_LITE_CONFIG,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
}


# ---- weights --------------------------------------------------------------------------------------


def random_weights(cfg: DeepseekConfig, device: torch.device, dtype: torch.dtype, seed: int) -> dict:
    """Our checkpoint naming (expected_weights), generated on `device`: projections N(0, 1/fan_in), norms 1,
    router weight and e_score_correction_bias float32 (the bias small and non-zero, so it changes routing)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    with torch.no_grad():
        for name, shape in expected_weights(cfg).items():
            tensor_dtype = torch.float32 if FLOAT32_WEIGHTS.search(name) else dtype
            if name.endswith("norm.weight"):
                weights[name] = torch.ones(shape, device=device, dtype=tensor_dtype)
            elif name.endswith("e_score_correction_bias"):
                weights[name] = torch.randn(shape, generator=generator, device=device, dtype=tensor_dtype) * 0.01
            else:
                weights[name] = torch.randn(shape, generator=generator, device=device, dtype=tensor_dtype)
                weights[name] *= shape[-1] ** -0.5
    return weights


def fused_experts(model) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Layer index -> (w13 [E, 2I, D], w2 [E, D, I]) that our model already stacked (its MoE internals);
    empty if the model no longer keeps them that way, in which case callers stack their own."""
    cfg, stacks = model.config, {}
    for i, layer in enumerate(model.layers):
        mlp = layer[-1]
        w13, w2 = getattr(mlp, "w13", None), getattr(mlp, "w2", None)
        shape13 = (cfg.n_routed_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
        if cfg.is_moe_layer(i):
            if w13 is None or tuple(w13.shape) != shape13 or w2.dim() != 3:
                return {}
            stacks[i] = (w13, w2)
    return stacks


def share_expert_storage(weights: dict, cfg: DeepseekConfig, stacks: dict) -> None:
    """Point the per-expert entries of `weights` at views of the stacked tensors, freeing the originals."""
    inner = cfg.moe_intermediate_size
    for i, (w13, w2) in stacks.items():
        for e in range(cfg.n_routed_experts):
            p = f"model.layers.{i}.mlp.experts.{e}"
            weights[f"{p}.gate_proj.weight"] = w13[e, :inner]
            weights[f"{p}.up_proj.weight"] = w13[e, inner:]
            weights[f"{p}.down_proj.weight"] = w2[e]


def hf_state_dict(weights: dict, cfg: DeepseekConfig, stacks: dict) -> dict:
    """Our names -> transformers 5.x names: experts fused per layer as mlp.experts.gate_up_proj [E, 2I, D]
    (gate rows first, then up) and mlp.experts.down_proj [E, D, I]; every other name is the same."""
    state = {name: t for name, t in weights.items() if ".mlp.experts." not in name}
    for i in range(cfg.num_hidden_layers):
        if not cfg.is_moe_layer(i):
            continue
        if i in stacks:
            w13, w2 = stacks[i]
        else:
            p = f"model.layers.{i}.mlp.experts"
            experts = range(cfg.n_routed_experts)
            w13 = torch.stack(
                [torch.cat([weights[f"{p}.{e}.gate_proj.weight"], weights[f"{p}.{e}.up_proj.weight"]]) for e in experts]
            )
            w2 = torch.stack([weights[f"{p}.{e}.down_proj.weight"] for e in experts])
        state[f"model.layers.{i}.mlp.experts.gate_up_proj"] = w13
        state[f"model.layers.{i}.mlp.experts.down_proj"] = w2
    return state


def hf_model(raw_config: dict, state: dict, device: torch.device):
    """transformers' DeepseekV3ForCausalLM built on the meta device, its parameters then *assigned* from
    `state` (sharing storage, no copy). Fails loudly if the names do not match this transformers version."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(**raw_config)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)
    expected = set(model.state_dict())
    if expected != set(state):
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise RuntimeError(
            f"transformers' DeepseekV3ForCausalLM names differ from the mapping in bench/_gpu.py: it wants "
            f"{missing[:4]} ({len(missing)} missing) and does not know {extra[:4]} ({len(extra)} extra); update "
            f"hf_state_dict for this transformers version"
        )
    model.load_state_dict(state, strict=True, assign=True)
    with torch.device(device):  # non-persistent buffers (rotary tables) are not in the state dict
        model.model.rotary_emb = type(model.model.rotary_emb)(config)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:
        raise RuntimeError(f"transformers model still has tensors on the meta device: {left[:4]}")
    return model.requires_grad_(False).eval()


# ---- device -------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_info(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"type": device.type}
    props = torch.cuda.get_device_properties(device)
    driver = "unknown"
    try:
        with open("/proc/driver/nvidia/version") as f:
            driver = next(w for w in f.readline().split() if w[0].isdigit() and "." in w)
    except (OSError, StopIteration):
        pass
    return {
        "type": "cuda",
        "gpu_name": props.name,
        "driver": driver,
        "cuda_runtime": torch.version.cuda,
        "compute_capability": f"{props.major}.{props.minor}",
        "sms": props.multi_processor_count,
        "total_memory_bytes": props.total_memory,
    }


def extra_versions() -> dict:
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"triton": version("triton") or version("pytorch-triton"), "matplotlib": version("matplotlib")}


def _timed(fn, device: torch.device, repeats: int) -> list[float]:
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def measure_copy_bandwidth(device: torch.device, mebibytes: int, repeats: int = 10) -> dict:
    """Median device-to-device copy of a large buffer; bytes counted as read + write."""
    src = torch.empty(mebibytes << 20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    times = _timed(lambda: dst.copy_(src), device, repeats)
    median = sorted(times)[len(times) // 2]
    return {
        "buffer_bytes": mebibytes << 20,
        "repeats": repeats,
        "median_seconds": median,
        "gb_per_s": 2 * (mebibytes << 20) / median / 1e9,
    }


def measure_gemm(device: torch.device, dtype: torch.dtype, size: int, repeats: int = 10, inner: int = 5) -> dict:
    """Median rate of a size^3 matmul on random data (each sample runs `inner` matmuls back to back)."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)

    def run():
        for _ in range(inner):
            a @ b

    times = _timed(run, device, repeats)
    median = sorted(times)[len(times) // 2] / inner
    return {
        "shape": [size, size, size],
        "dtype": str(dtype).removeprefix("torch."),
        "median_seconds": median,
        "tflop_per_s": 2 * size**3 / median / 1e12,
    }


# ---- bounds -------------------------------------------------------------------------------------


def model_sizes(cfg: DeepseekConfig, dtype: torch.dtype) -> dict:
    """Parameter counts and bytes by kind, from the shapes our model reads."""
    sizes = {"embedding": 0, "lm_head": 0, "routed_experts": 0, "other": 0}
    other_bytes = 0
    for name, shape in expected_weights(cfg).items():
        numel = math.prod(shape)
        if name == "model.embed_tokens.weight":
            sizes["embedding"] += numel
        elif name == "lm_head.weight":
            sizes["lm_head"] += numel
        elif ".mlp.experts." in name:
            sizes["routed_experts"] += numel
        else:
            sizes["other"] += numel  # attention, dense MLP, shared experts, norms, routers
            other_bytes += numel * (4 if FLOAT32_WEIGHTS.search(name) else dtype.itemsize)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    expert_params = sizes["routed_experts"] // max(1, moe_layers * cfg.n_routed_experts)
    lm_head = sizes["lm_head"] or sizes["embedding"]  # tied: the embedding doubles as the head
    top_k = cfg.routing.top_k if cfg.routing else 0
    return {
        "params": sizes,
        "params_total": sum(sizes.values()),
        "moe_layers": moe_layers,
        "params_per_expert": expert_params,
        "active_params_per_token": sizes["other"] + lm_head + moe_layers * top_k * expert_params,
        "other_bytes": other_bytes,
        "lm_head_params": lm_head,
        "itemsize": dtype.itemsize,
    }


def decode_step_bound(cfg: DeepseekConfig, sizes: dict, batch: int, context: float, bw: float, flops_s: float) -> dict:
    """Lower bound on one decode step of `batch` sequences of mean `context` tokens."""
    experts, top_k = cfg.n_routed_experts, cfg.routing.top_k if cfg.routing else 0
    touched = experts * (1 - (1 - top_k / experts) ** batch) if experts else 0.0  # uniform-routing expectation
    item = sizes["itemsize"]
    weight_bytes = (
        sizes["other_bytes"]
        + sizes["lm_head_params"] * item
        + sizes["moe_layers"] * touched * sizes["params_per_expert"] * item
        + batch * cfg.hidden_size * item  # the embedding rows gathered
    )
    kv_bytes = batch * context * cfg.latent_dim * item * cfg.num_hidden_layers  # the MLA latents, read once
    # flops: 2 per active weight per token, plus absorbed-MLA attention over the latents:
    # scores 2 * H * ctx * (C + R) and output 2 * H * ctx * C per token per layer
    heads, c = cfg.num_attention_heads, cfg.kv_lora_rank
    attention = 2 * heads * context * (cfg.latent_dim + c) * cfg.num_hidden_layers
    flops = batch * (2 * sizes["active_params_per_token"] + attention)
    memory_s, compute_s = (weight_bytes + kv_bytes) / bw, flops / flops_s
    return {
        "expected_experts_touched_per_layer": touched,
        "weight_bytes": weight_bytes,
        "kv_bytes": kv_bytes,
        "flops": flops,
        "memory_bound_ms": 1e3 * memory_s,
        "compute_bound_ms": 1e3 * compute_s,
        "bound_ms": 1e3 * max(memory_s, compute_s),
        "bound_tokens_per_s": batch / max(memory_s, compute_s),
    }


def prefill_bound(cfg: DeepseekConfig, sizes: dict, prompts: int, length: int, flops_s: float, bw: float) -> dict:
    """Lower bound on prefilling `prompts` x `length` tokens (one next-token logit row per prompt).

    flops = 2 * (active params per token - lm_head) * tokens + 2 * lm_head * prompts
          + layers * heads * 2 * (qk_head_dim + v_head_dim) * prompts * length * (length + 1) / 2
    (causal attention in the non-absorbed form, the cheaper one for prefill; kv_b_proj is in the params).
    """
    tokens = prompts * length
    head_params = sizes["lm_head_params"]
    dense = 2 * (sizes["active_params_per_token"] - head_params) * tokens + 2 * head_params * prompts
    attention = (
        cfg.num_hidden_layers
        * cfg.num_attention_heads
        * 2
        * (cfg.qk_head_dim + cfg.v_head_dim)
        * prompts
        * length
        * (length + 1)
        / 2
    )
    all_weight_bytes = (
        sizes["other_bytes"] + (sizes["lm_head_params"] + sizes["params"]["routed_experts"]) * sizes["itemsize"]
    )
    compute_s, memory_s = (dense + attention) / flops_s, all_weight_bytes / bw
    return {
        "tokens": tokens,
        "flops": dense + attention,
        "attention_flops": attention,
        "compute_bound_ms": 1e3 * compute_s,
        "memory_bound_ms": 1e3 * memory_s,
        "bound_ms": 1e3 * max(compute_s, memory_s),
        "bound_tokens_per_s": tokens / max(compute_s, memory_s),
    }


def summarise(report: dict, cfg: DeepseekConfig, dtype: torch.dtype) -> None:
    """Add the bounds, each result's fraction of its bound, and the cross-system comparisons to `report`."""
    work, sizes = report["workload"], report["params"]
    bw = report["measurements"]["copy_bandwidth"]["gb_per_s"] * 1e9
    peak = report["measurements"]["gemm"]["tflop_per_s"] * 1e12
    context = work["prompt_len"] + work["new_tokens"] / 2  # mean context over the decode steps
    bound = {str(b): decode_step_bound(cfg, sizes, b, context, bw, peak) for b in work["batches"]}
    prefill = prefill_bound(cfg, sizes, *work["prefill"], peak, bw)
    report["bound"] = {
        "note": "decode, per step: (weights read: all non-expert weights, the lm_head, and E(1 - (1 - k/E)^B) "
        "routed experts per MoE layer, the expected number touched under UNIFORM routing; plus the MLA latent KV, "
        f"B x ctx x {cfg.latent_dim} x layers, at the mean decode context ctx = {context}) / measured copy "
        "bandwidth; compute = flops / measured GEMM peak; bound = the larger. Prefill: flops (formula in "
        "prefill_bound, bench/_gpu.py) / GEMM peak, or all weights once / bandwidth if larger.",
        "decode": bound,
        "prefill": prefill,
    }
    decode = report["decode"]
    for per_batch in decode.values():
        for b, r in per_batch.items():
            r["fraction_of_bound"] = bound[b]["bound_ms"] / r["ms_per_step"]
            r["fraction_of_memory_bound"] = bound[b]["memory_bound_ms"] / r["ms_per_step"]
    for r in report["prefill"].values():
        r["tokens_per_s"] = r["tokens"] / r["seconds"]
        r["tflop_per_s"] = prefill["flops"] / r["seconds"] / 1e12
        r["fraction_of_bound"] = prefill["bound_ms"] / 1e3 / r["seconds"]
    comparisons = {
        "speedup_vs_hf": {},
        "batch_invariant_over_default_throughput": {},
        "token_match_vs_hf": {},
        "token_match_batch_invariant_vs_default": {},
    }
    hf, invariant = decode.get("hf", {}), decode.get("ours_batch_invariant", {})
    for b, r in decode.get("ours_default", {}).items():
        if b in hf:
            comparisons["speedup_vs_hf"][b] = hf[b]["ms_per_step"] / r["ms_per_step"]
            comparisons["token_match_vs_hf"][b] = token_match(r["tokens"], hf[b]["tokens"])
        if b in invariant:
            comparisons["batch_invariant_over_default_throughput"][b] = invariant[b]["tokens_per_s"] / r["tokens_per_s"]
            comparisons["token_match_batch_invariant_vs_default"][b] = token_match(invariant[b]["tokens"], r["tokens"])
    comparisons["note"] = (
        "token_match_*: greedy tokens of the timed runs (same prompts, benchmark dtype); informational"
    )
    report["comparisons"] = comparisons
    for per_batch in decode.values():
        for r in per_batch.values():
            r.pop("tokens")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def token_match(a: list[list[int]], b: list[list[int]]) -> dict:
    """How alike two runs' greedy tokens are (same prompts, same order)."""
    same = sum(x == y for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b))
    return {
        "identical_token_fraction": same / sum(len(row) for row in a),
        "identical_sequences": sum(row_a == row_b for row_a, row_b in zip(a, b)),
        "sequences": len(a),
    }


def write_plot(path, decode: dict, bound: dict, title: str) -> dict:
    """ms per decode step against batch for each system and the HBM bound (log-log); PNG via Agg."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {"written": False, "reason": "matplotlib is not installed"}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = {"ours_default": "DeepInfer", "ours_batch_invariant": "DeepInfer, batch-invariant", "hf": "transformers"}
    for name, label in labels.items():
        points = sorted((int(b), r["ms_per_step"]) for b, r in decode.get(name, {}).items())
        if points:
            ax.plot(*zip(*points), marker="o", label=label)
    bound_points = sorted((int(b), v["memory_bound_ms"]) for b, v in bound.items())
    ax.plot(*zip(*bound_points), "k--", label="memory bound (weights + KV read / measured copy bandwidth)")
    ax.set(xscale="log", yscale="log", xlabel="batch (sequences)", ylabel="ms per decode step", title=title)
    ax.set_xticks([b for b, _ in bound_points], [str(b) for b, _ in bound_points])
    ax.minorticks_off()
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return {"written": True, "path": str(path)}
