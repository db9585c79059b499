"""Models of gpu_decode.py: configs, random weights on the backend's device, their FP8 copy, the transformers twin."""

from __future__ import annotations

import torch

from deepinfer_core.backend.ops import BlockFP8
from deepinfer_core.model.config import DeepseekConfig
from deepinfer_core.model.deepseek_v3 import FLOAT32_WEIGHTS, FP8_WEIGHTS, DeepseekV3Model, expected_weights
from deepinfer_core.model.layers import DenseMLP, MLAttention, MoE

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
# The FP8 agreement check's config: TINY_CONFIG widened so that every FP8 weight stays FP8 in the model,
# the gate | up expert stacks included (BlockFP8.concat_rows dequantizes rows that are not whole 128-row blocks).
TINY_FP8_CONFIG = {**TINY_CONFIG, "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 128}


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


# ---- FP8 ----------------------------------------------------------------------------------------


def quantize_fp8(weights: dict, max_elements: int = 1 << 26) -> dict:
    """`weights` with every FP8_WEIGHTS match replaced by BlockFP8.quantize(w), on w's device; others are the
    same tensors (shared, not copied). A weight over `max_elements` is quantized in chunks of whole 128-row
    blocks (the same result), bounding the float32 temporaries of the quantization."""
    with torch.no_grad():
        return {name: _quantize(w, max_elements) if FP8_WEIGHTS.search(name) else w for name, w in weights.items()}


def _quantize(weight: torch.Tensor, max_elements: int, block: tuple[int, int] = (128, 128)) -> BlockFP8:
    rows = weight.shape[-2]
    per_row = max(1, weight.numel() // max(1, rows))
    chunk = max(block[0], max_elements // per_row // block[0] * block[0])
    if rows <= chunk:
        return BlockFP8.quantize(weight, block)
    parts = [BlockFP8.quantize(weight[..., i : i + chunk, :], block) for i in range(0, rows, chunk)]
    return BlockFP8(torch.cat([p.weight for p in parts], -2), torch.cat([p.scale for p in parts], -2), block)


def dequantized(weights: dict, dtype: torch.dtype) -> dict:
    """The values the BlockFP8 entries of `weights` stand for, in `dtype` (the model a loader dequantizes)."""
    return {name: w.dequantize(dtype) if isinstance(w, BlockFP8) else w for name, w in weights.items()}


def fp8_held(model: DeepseekV3Model) -> dict:
    """How many BlockFP8 tensors the model's layers hold, and their bytes (FP8 values + float32 scales)."""
    held = []

    def walk(obj) -> None:
        if isinstance(obj, BlockFP8):
            held.append(obj)
        elif isinstance(obj, dict | list | tuple):
            for item in obj.values() if isinstance(obj, dict) else obj:
                walk(item)
        elif isinstance(obj, DenseMLP | MoE | MLAttention):
            walk(vars(obj))

    walk(model.layers)
    nbytes = sum(t.weight.numel() * t.weight.element_size() + t.scale.numel() * t.scale.element_size() for t in held)
    return {"tensors": len(held), "bytes": nbytes}
