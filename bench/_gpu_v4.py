"""DeepSeek-V4 / V4.1 models of gpu_decode.py (--model v4 | v41): configs, random weights on the device, our
model with its expert stacks shared, and transformers' DeepseekV4ForCausalLM on the same tensors."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_core.model.config_v4 import CSA, HCA, SLIDING, DeepseekV4Config
from deepinfer_core.model.config_v41 import DeepseekV41Config
from deepinfer_core.model.deepseek_v4 import FLOAT32_WEIGHTS_V4, DeepseekV4Model, expected_weights_v4
from deepinfer_core.model.deepseek_v41 import FLOAT32_WEIGHTS_V41, DeepseekV41Model, expected_weights_v41

YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536}  # V4 / V4.1 Flash's
# DeepSeek-V4 at V4-Flash width (transformers 5.24's DeepseekV4Config defaults are V4 Flash's sizes), 4 layers
# (sliding, CSA, HCA, CSA) and 32 of V4 Flash's 256 experts, top-6; the first MoE layer hash-routed (V4 Flash:
# the first 3 of 43).
V4_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "vocab_size": 129280,
    "hidden_size": 4096,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 4,
    "layer_types": [SLIDING, CSA, HCA, CSA],
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    "compress_rates": {CSA: 4, HCA: 128},
    "sliding_window": 128,
    "num_attention_heads": 64,
    "head_dim": 512,
    "partial_rotary_factor": 0.125,  # 64 rope dims
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "n_routed_experts": 32,
    "num_experts_per_tok": 6,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "max_position_embeddings": 65536,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_parameters": YARN,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
# The same at tiny widths for the CPU smoke run (and the greedy-agreement check): windows and rates small
# enough that 16-token prompts fill rings and finish compressed entries; indexer top-k above the entry count.
V4_TINY = {
    **V4_CONFIG,
    "vocab_size": 512,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "compress_rates": {CSA: 4, HCA: 8},
    "sliding_window": 8,
    "num_attention_heads": 4,
    "head_dim": 32,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 64,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 4096,
}
# DeepSeek-V4.1 at its released width (every field not given is config_v41's released default: hidden 5120,
# 64 heads x 512, q_lora 1280, o_groups 8 x 1024, index 32 heads x 128 top-512, candidate blocks 2048 x 8,
# moe_intermediate 2304, top-6, sqrtsoftplus, hc 4, window 128), 5 layers of the released schedule's shape
# (a sliding layer, a ratio-2 group, a ratio-1 group: kv / index sources 1 and 3, candidate source 3), 32 of
# its 384 experts, no engram layers, no DSpark draft layers (DeepInfer does not run them).
V41_CONFIG = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41_text",
    "num_hidden_layers": 5,
    "compress_ratios": [0, 2, 2, 1, 1],
    "n_routed_experts": 32,
    "num_nextn_predict_layers": 0,
    "engram_layer_ids": [],
    "max_position_embeddings": 65536,
    "rope_scaling": YARN,
}
V41_TINY = {
    **V41_CONFIG,
    "vocab_size": 512,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "head_dim": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "o_groups": 2,
    "o_lora_rank": 16,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 64,
    "candidate_topk_blocks": 4,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
    "max_position_embeddings": 4096,
}
NO_HF_V41 = "transformers: no deepseek_v41 in 5.24; the reference is not on pip"


@dataclass(frozen=True, slots=True)
class Family:
    """What differs between DeepSeek-V4 and V4.1 for this benchmark."""

    name: str  # the --model value
    title: str
    parse: Any  # raw config -> parsed config
    model: type
    expected_weights: Any  # parsed config -> {name: shape}
    float32_weights: re.Pattern
    hf_unavailable: str | None  # why transformers has no twin, or None


FAMILIES = {
    "v4": Family(
        "v4", "DeepSeek-V4", DeepseekV4Config.from_hf, DeepseekV4Model, expected_weights_v4, FLOAT32_WEIGHTS_V4, None
    ),
    "v41": Family(
        "v41",
        "DeepSeek-V4.1",
        DeepseekV41Config.from_hf,
        DeepseekV41Model,
        expected_weights_v41,
        FLOAT32_WEIGHTS_V41,
        NO_HF_V41,
    ),
}
CONFIGS = {"v4": (V4_CONFIG, V4_TINY), "v41": (V41_CONFIG, V41_TINY)}
_ONES = ("norm.weight", "_scale", "q_weight", "k_weight")
_HALF_NORMAL = ("attn_sink", "_base", "gate.bias", ".ape")  # additive logits and biases: N(0, 0.5)


# ---- weights ------------------------------------------------------------------------------------


def random_weights(family: Family, cfg, device: torch.device, dtype: torch.dtype, seed: int) -> dict:
    """Our checkpoint naming, generated on `device`: norms and mixer scales 1, sinks / mixer bases / router
    biases / compressor position biases N(0, 0.5), matrices N(0, 1/fan_in), the hash-routing tables distinct
    random experts per token. Drawn in `dtype`, then widened where the model keeps float32 (routers, mixers,
    sinks), so that transformers, which keeps some of them in `dtype`, sees the same values."""
    return random_tensors(family.expected_weights(cfg), family.float32_weights, cfg, device, dtype, seed)


def random_tensors(shapes: dict, float32_weights: re.Pattern, cfg, device: torch.device, dtype: torch.dtype,
                   seed: int) -> dict:  # fmt: skip
    """random_weights' draws for the tensors `shapes` names (float32 where `float32_weights` matches)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    with torch.no_grad():
        for name, shape in shapes.items():
            if name.endswith("tid2eid"):
                scores = torch.rand((shape[0], cfg.n_routed_experts), generator=generator, device=device)
                weights[name] = scores.argsort(dim=1)[:, : shape[1]].contiguous()
                continue
            if name.endswith(_ONES):
                tensor = torch.ones(shape, device=device, dtype=dtype)
            else:
                tensor = torch.randn(shape, generator=generator, device=device, dtype=dtype)
                tensor *= 0.5 if name.endswith(_HALF_NORMAL) else shape[-1] ** -0.5
            weights[name] = tensor.float() if float32_weights.search(name) else tensor
    return weights


def build_ours(family: Family, cfg, weights: dict, backend) -> tuple[Any, dict]:
    """Our model on `backend`; the per-expert entries of `weights` then become views of the model's stacks
    (freeing the originals). -> (model, {layer: (w13 [E, 2I, D], w2 [E, D, I])})."""
    model = family.model(cfg, weights, backend)
    stacks = {i: (layer[3].w13, layer[3].w2) for i, layer in enumerate(model.layers)}
    inner = cfg.moe_intermediate_size
    for i, (w13, w2) in stacks.items():
        for e in range(cfg.n_routed_experts):
            p = f"model.layers.{i}.ffn.experts.{e}"
            weights[f"{p}.w1.weight"], weights[f"{p}.w3.weight"], weights[f"{p}.w2.weight"] = (
                w13[e, :inner],
                w13[e, inner:],
                w2[e],
            )
    return model, stacks


# ---- transformers' DeepseekV4ForCausalLM on the same tensors --------------------------------------

# Our (DeepSeek's) names -> transformers 5.x names: the renames of transformers' conversion_mapping.py
# ("deepseek_v4"), written for our `model.`-prefixed names; experts are fused separately.
_HF_V4_RENAMES = [
    (r"^head\.weight$", "lm_head.weight"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn\.indexer\.compressor\.", ".self_attn.compressor.indexer."),
    (r"\.attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
    (r"\.attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.scorer.weights_proj."),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.attn_sink$", ".sinks"),
    (r"\.ape$", ".position_bias"),
    (r"(\.self_attn(\.compressor(\.indexer)?)?)\.norm\.weight$", r"\1.kv_norm.weight"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.wq_b\.", ".q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
]


def hf_name(name: str) -> str:
    for pattern, replacement in _HF_V4_RENAMES:
        name = re.sub(pattern, replacement, name)
    return name


def hf_state_dict(weights: dict, cfg: DeepseekV4Config, stacks: dict) -> dict:
    """Our V4 names -> transformers' names; experts fused per layer as mlp.experts.gate_up_proj [E, 2I, D]
    (w1 rows, then w3) and mlp.experts.down_proj [E, D, I]: our model's stacks where given (shared)."""
    state = {hf_name(name): t for name, t in weights.items() if ".ffn.experts." not in name}
    for i in range(cfg.num_hidden_layers):
        if i in stacks:
            w13, w2 = stacks[i]
        else:
            p = f"model.layers.{i}.ffn.experts"
            gate_up = [[weights[f"{p}.{e}.w{n}.weight"] for n in (1, 3)] for e in range(cfg.n_routed_experts)]
            w13 = torch.stack([torch.cat(pair) for pair in gate_up])
            w2 = torch.stack([weights[f"{p}.{e}.w2.weight"] for e in range(cfg.n_routed_experts)])
        state[f"model.layers.{i}.mlp.experts.gate_up_proj"] = w13
        state[f"model.layers.{i}.mlp.experts.down_proj"] = w2
    return state


def hf_model(raw_config: dict, state: dict, device: torch.device, dtype: torch.dtype):
    """transformers' DeepseekV4ForCausalLM built on the meta device in `dtype` (its float32 modules as it keeps
    them), its parameters and buffers then *assigned* from `state`: shared where the dtypes agree, a copy in
    transformers' dtype where they do not (norms, routers: small). Its rotary tables, which are not in the
    state dict, are rebuilt on `device`. Fails loudly if the names do not match this transformers version."""
    from transformers import DeepseekV4Config as HFConfig
    from transformers import DeepseekV4ForCausalLM

    config = HFConfig(**{k: v for k, v in raw_config.items() if k != "architectures"})
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = DeepseekV4ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    expected = model.state_dict()
    if set(expected) != set(state):
        missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        raise RuntimeError(
            f"transformers' DeepseekV4ForCausalLM names differ from the mapping in bench/_gpu_v4.py: it wants "
            f"{missing[:4]} ({len(missing)} missing) and does not know {extra[:4]} ({len(extra)} extra); update "
            "_HF_V4_RENAMES for this transformers version"
        )
    model.load_state_dict({n: t.to(expected[n].dtype) for n, t in state.items()}, strict=True, assign=True)
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):  # non-persistent: the rotary tables
            parent, _, attr = name.rpartition(".")
            with torch.device(device):
                setattr(model.get_submodule(parent), attr, type(module)(config))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:
        raise RuntimeError(f"transformers model still has tensors on the meta device: {left[:4]}")
    model.generation_config.eos_token_id = None  # never stops early: our ignore_eos
    model.generation_config.pad_token_id = 0
    return model.requires_grad_(False).eval()
