"""Measurements of gpu_decode.py: device facts, copy bandwidth, GEMM peak (torch.cuda only on CUDA), and bounds."""

from __future__ import annotations

import importlib.metadata
import math
import re
import subprocess
import time

import torch

from deepinfer_core.model.config import DeepseekConfig
from deepinfer_core.model.deepseek_v3 import FLOAT32_WEIGHTS, FP8_WEIGHTS, expected_weights

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


# the GPU's clocks, power, temperature and why it slows its clocks, if it does (nvidia-smi's names; a field the
# driver does not know reads as its error)
GPU_STATE_FIELDS = ("clocks.sm", "clocks.max.sm", "power.draw", "temperature.gpu", "clocks_event_reasons.active")


def gpu_state(device: torch.device) -> dict:
    """nvidia-smi's GPU_STATE_FIELDS now ({} off CUDA): beside a timing, to tell throttling from code."""
    if device.type != "cuda":
        return {}
    state = {}
    for field in GPU_STATE_FIELDS:
        query = ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"]
        try:
            done = subprocess.run(query, capture_output=True, text=True, timeout=10)
            lines = (done.stdout or done.stderr).strip().splitlines()
            state[field] = lines[0] if lines else ""
        except (OSError, subprocess.TimeoutExpired) as err:
            state[field] = f"unavailable: {err}"
    return state


def replayed_ms(fn, device: torch.device, repeats: int, inner: int) -> float:
    """Median milliseconds of one fn() call. On a GPU `inner` calls are captured in one CUDA graph and replayed,
    as the engine replays its decode steps: device time, not the host's launch overhead (a Triton launch from
    Python can take longer than a small kernel runs). Elsewhere the calls run eagerly."""
    fn()
    sync(device)

    def run() -> None:
        for _ in range(inner):
            fn()

    if device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        run = graph.replay
    times = sorted(_timed(run, device, repeats))
    return times[len(times) // 2] / inner * 1e3


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


FP8_BLOCK = (128, 128)  # BlockFP8.quantize's default, DeepSeek's checkpoints' block
_GATE_UP = re.compile(r"\.(gate|up)_proj\.weight$")


def weight_bytes(name: str, shape: tuple[int, ...], dtype: torch.dtype, fp8: bool = False) -> int:
    """Bytes our model holds for one weight: routers float32, the rest `dtype`; with `fp8`, FP8_WEIGHTS at
    1 byte per element + a float32 scale per [128, 128] block, except gate/up pairs whose gate rows are not
    whole 128-row blocks (BlockFP8.concat_rows then keeps their concatenation dequantized, in `dtype`)."""
    numel = math.prod(shape)
    if FLOAT32_WEIGHTS.search(name):
        return 4 * numel
    if fp8 and FP8_WEIGHTS.search(name) and not (_GATE_UP.search(name) and shape[-2] % FP8_BLOCK[0]):
        blocks = math.prod(shape[:-2]) * -(-shape[-2] // FP8_BLOCK[0]) * -(-shape[-1] // FP8_BLOCK[1])
        return numel + 4 * blocks
    return numel * dtype.itemsize


def fp8_dequantized_gate_up(cfg: DeepseekConfig) -> list[str]:
    """The MLPs whose gate | up pair the FP8 model keeps dequantized (rows not whole 128-row blocks)."""
    return [
        name.removesuffix(".gate_proj.weight")
        for name, shape in expected_weights(cfg).items()
        if name.endswith(".gate_proj.weight") and shape[-2] % FP8_BLOCK[0]
    ]


def model_sizes(cfg: DeepseekConfig, dtype: torch.dtype, fp8: bool = False) -> dict:
    """Parameter counts and bytes by kind, from the shapes our model reads (`fp8`: FP8 weights as BlockFP8)."""
    sizes = {"embedding": 0, "lm_head": 0, "routed_experts": 0, "other": 0}
    nbytes, fp8_bytes = dict.fromkeys(sizes, 0), 0
    for name, shape in expected_weights(cfg).items():
        if name == "model.embed_tokens.weight":
            kind = "embedding"
        elif name == "lm_head.weight":
            kind = "lm_head"
        elif ".mlp.experts." in name:
            kind = "routed_experts"
        else:
            kind = "other"  # attention, dense MLP, shared experts, norms, routers
        held = weight_bytes(name, shape, dtype, fp8)
        sizes[kind] += math.prod(shape)
        nbytes[kind] += held
        fp8_bytes += held if held != weight_bytes(name, shape, dtype) else 0
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    experts = max(1, moe_layers * cfg.n_routed_experts)
    expert_params = sizes["routed_experts"] // experts
    lm_head = sizes["lm_head"] or sizes["embedding"]  # tied: the embedding doubles as the head
    top_k = cfg.routing.top_k if cfg.routing else 0
    return {
        "params": sizes,
        "params_total": sum(sizes.values()),
        "moe_layers": moe_layers,
        "params_per_expert": expert_params,
        "active_params_per_token": sizes["other"] + lm_head + moe_layers * top_k * expert_params,
        "other_bytes": nbytes["other"],
        "lm_head_params": lm_head,
        "itemsize": dtype.itemsize,
        "weight_format": "fp8_block" if fp8 else str(dtype).removeprefix("torch."),
        "bytes": nbytes,
        "bytes_total": sum(nbytes.values()),
        "bytes_per_expert": nbytes["routed_experts"] / experts,
        "lm_head_bytes": nbytes["lm_head"] or nbytes["embedding"],
        "fp8_bytes": fp8_bytes,  # of the weights held as BlockFP8 (values + scales)
    }


def decode_step_bound(cfg: DeepseekConfig, sizes: dict, batch: int, context: float, bw: float, flops_s: float) -> dict:
    """Lower bound on one decode step of `batch` sequences of mean `context` tokens."""
    experts, top_k = cfg.n_routed_experts, cfg.routing.top_k if cfg.routing else 0
    touched = experts * (1 - (1 - top_k / experts) ** batch) if experts else 0.0  # uniform-routing expectation
    item = sizes["itemsize"]
    weights_read = (
        sizes["other_bytes"]
        + sizes["lm_head_bytes"]
        + sizes["moe_layers"] * touched * sizes["bytes_per_expert"]
        + batch * cfg.hidden_size * item  # the embedding rows gathered (the embedding is never FP8)
    )
    kv_bytes = batch * context * cfg.latent_dim * item * cfg.num_hidden_layers  # the MLA latents, read once
    # flops: 2 per active weight per token, plus absorbed-MLA attention over the latents:
    # scores 2 * H * ctx * (C + R) and output 2 * H * ctx * C per token per layer
    heads, c = cfg.num_attention_heads, cfg.kv_lora_rank
    attention = 2 * heads * context * (cfg.latent_dim + c) * cfg.num_hidden_layers
    flops = batch * (2 * sizes["active_params_per_token"] + attention)
    memory_s, compute_s = (weights_read + kv_bytes) / bw, flops / flops_s
    return {
        "expected_experts_touched_per_layer": touched,
        "weight_bytes": weights_read,
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
    return prefill_bound_record(tokens, dense, attention, sizes, flops_s, bw)


def prefill_bound_record(tokens: int, dense: float, attention: float, sizes: dict, flops_s: float, bw: float) -> dict:
    """A prefill's bound: its flops (dense + attention) over the GEMM peak, or every weight read once (the
    sizes of `model_sizes`) over the copy bandwidth, whichever is longer."""
    all_weight_bytes = sizes["other_bytes"] + sizes["lm_head_bytes"] + sizes["bytes"]["routed_experts"]
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
