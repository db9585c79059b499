"""Tiny random Hugging Face DeepSeek-V4 checkpoints for the parity tests (issue 8), and the HF model as oracle.

`build_v4_checkpoint(variant, root)` makes a seeded `transformers.DeepseekV4ForCausalLM`, fills the
parameters transformers initialises to zero (attention sinks, compressor position biases, hyper-
connection biases, the hash-routing table, router biases) with random values so that every path is
exercised, saves it with `save_pretrained` under `root/variant` and returns it with the float32 HF model.
`build_v4_mtp_checkpoint(root)` does the same for a model with one more layer, then stores that layer as
the checkpoint's MTP block (`mtp.0.*`, DeepSeek's spelling) beside random MTP inputs and head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB = 256
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    moe_intermediate_size=32,
    num_attention_heads=4,
    head_dim=32,
    q_lora_rank=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    o_lora_rank=16,
    index_n_heads=2,
    index_head_dim=16,
    max_position_embeddings=4096,
    initializer_range=0.1,  # logits of std ~0.8: far outside the float32 tolerance when anything differs
    bos_token_id=0,
    eos_token_id=1,
)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32, "beta_slow": 1}
VARIANTS = {
    # (a) the three attention types, YaRN on the compressed ones, hash routing first; indexer top-k above
    # the entry count (exact parity: with a small k, ReLU's exact-zero scores tie and torch.topk breaks
    # ties its own way)
    "a": dict(
        num_hidden_layers=4,
        layer_types=[SLIDING, CSA, HCA, CSA],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={CSA: 4, HCA: 8},
        sliding_window=8,
        o_groups=2,
        index_topk=64,
        hc_mult=2,
        hc_sinkhorn_iters=5,
        rope_parameters=YARN,
    ),
    # (b) other rates and window, three streams, plain RoPE, two hash layers, a small indexer top-k
    "b": dict(
        num_hidden_layers=3,
        layer_types=[HCA, CSA, SLIDING],
        mlp_layer_types=["hash_moe", "hash_moe", "moe"],
        compress_rates={CSA: 2, HCA: 16},
        sliding_window=5,
        o_groups=4,
        index_topk=64,
        hc_mult=3,
        hc_sinkhorn_iters=3,
        swiglu_limit=0.5,  # low enough that the clamp acts on these activations
    ),
    # (sliding) every layer sliding-window only: no paged cache at all, only the per-sequence windows
    "sliding": dict(
        num_hidden_layers=2,
        layer_types=[SLIDING, SLIDING],
        mlp_layer_types=["hash_moe", "moe"],
        sliding_window=6,
        o_groups=2,
        index_topk=64,
        hc_mult=2,
        hc_sinkhorn_iters=3,
    ),
}
SEEDS = {"a": 4321, "b": 8765, "sliding": 2468}


@dataclass(frozen=True)
class Checkpoint:
    variant: str
    path: Path
    hf_model: torch.nn.Module  # DeepseekV4ForCausalLM, eval mode, float32


def _fill_zero_initialised_(model: torch.nn.Module, generator: torch.Generator, experts: int, top_k: int) -> None:
    def normal(shape, std):
        return std * torch.randn(shape, generator=generator)

    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith(("position_bias", "sinks")):
                param.copy_(normal(param.shape, 0.5))
            elif name.endswith(("_hc.base", "hc_head.hc_base")):
                param.copy_(normal(param.shape, 0.5))
        for name, buffer in sorted(model.named_buffers()):
            if name.endswith("tid2eid"):
                rows = [torch.randperm(experts, generator=generator)[:top_k] for _ in range(buffer.shape[0])]
                buffer.copy_(torch.stack(rows))
            elif name.endswith("e_score_correction_bias"):
                buffer.copy_(normal(buffer.shape, 0.05))


def _build(variant: str, root: Path) -> Checkpoint:
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(SEEDS[variant])
    config = DeepseekV4Config(**BASE, **VARIANTS[variant])
    model = DeepseekV4ForCausalLM(config).to(torch.float32).eval()
    _fill_zero_initialised_(
        model, torch.Generator().manual_seed(SEEDS[variant]), config.n_routed_experts, config.num_experts_per_tok
    )
    model.generation_config.eos_token_id = None  # the oracle never stops early
    model.generation_config.pad_token_id = 0
    path = root / f"deepseek-v4-tiny-{variant}"
    model.save_pretrained(path)
    return Checkpoint(variant, path, model)


_built: dict[str, Checkpoint] = {}


def build_v4_checkpoint(variant: str, root: Path) -> Checkpoint:
    """The checkpoint of `variant` (a key of VARIANTS), built on first use under `root` (later roots are ignored)."""
    if variant not in _built:
        _built[variant] = _build(variant, Path(root))
    return _built[variant]


# the MTP variant: three layers and, as HF's fourth, the MTP block (sliding, top-k routed, as DeepSeek-V4's)
MTP_LAYERS = dict(
    num_hidden_layers=4,
    layer_types=[SLIDING, CSA, HCA, SLIDING],
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    compress_rates={CSA: 4, HCA: 8},
    sliding_window=8,
    o_groups=2,
    index_topk=64,
    hc_mult=2,
    hc_sinkhorn_iters=5,
)
MTP_SEED = 1357


@dataclass(frozen=True)
class MtpCheckpoint:
    path: Path
    hf_model: torch.nn.Module  # DeepseekV4ForCausalLM of num_hidden_layers + 1 layers, the last the MTP block
    mtp: dict[str, torch.Tensor]  # the MTP layer's own inputs and head, by their name after "mtp.0."


def _mtp_extras(hidden: int, streams: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    def normal(*shape, std=1.0):
        return std * torch.randn(shape, generator=generator)

    return {
        "enorm.weight": 1 + normal(hidden, std=0.1),
        "hnorm.weight": 1 + normal(hidden, std=0.1),
        "norm.weight": 1 + normal(hidden, std=0.1),
        "e_proj.weight": normal(hidden, hidden, std=hidden**-0.5),
        "h_proj.weight": normal(hidden, hidden, std=hidden**-0.5),
        "hc_head_fn": normal(streams, streams * hidden, std=0.1),
        "hc_head_base": normal(streams, std=0.5),
        "hc_head_scale": 1 + normal(1, std=0.1),
    }


def build_v4_mtp_checkpoint(root: Path) -> MtpCheckpoint:
    """A tiny DeepSeek-V4 checkpoint with one MTP layer (num_nextn_predict_layers 1), built on first use."""
    if "mtp" in _built:
        return _built["mtp"]
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(MTP_SEED)
    config = DeepseekV4Config(**BASE, **MTP_LAYERS)
    model = DeepseekV4ForCausalLM(config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(MTP_SEED)
    _fill_zero_initialised_(model, generator, config.n_routed_experts, config.num_experts_per_tok)
    path = Path(root) / "deepseek-v4-tiny-mtp"
    model.save_pretrained(path)
    assert not (path / "model.safetensors.index.json").exists()  # one file: rewritten below
    layers = config.num_hidden_layers - 1  # the model's; the last HF layer is the MTP block
    block = f"model.layers.{layers}."
    tensors = {}
    for name, tensor in load_file(path / "model.safetensors").items():
        if name.startswith(block):  # DeepSeek's spelling: mtp.0.*, the attention's KV norm attn.kv_norm
            name = "mtp.0." + name.removeprefix(block).replace("attn.norm.weight", "attn.kv_norm.weight")
        tensors[name] = tensor
    mtp = _mtp_extras(config.hidden_size, config.hc_mult, generator)
    save_file(tensors | {f"mtp.0.{name}": t for name, t in mtp.items()}, str(path / "model.safetensors"))
    raw = json.loads((path / "config.json").read_text())
    raw.update(num_hidden_layers=layers, num_nextn_predict_layers=1)  # layer_types keep the MTP's entry
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    _built["mtp"] = MtpCheckpoint(path, model, mtp)
    return _built["mtp"]
