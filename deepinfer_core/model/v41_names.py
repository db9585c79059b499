"""Where a DeepSeek-V4.1 checkpoint keeps each tensor the model needs, in the three spellings in use.

The model names its tensors as transformers' first `deepseek_v41` modelling file does (DeepSeek's own module
names under `model.`, and `lm_head.weight`). DeepSeek's native checkpoints use the same names without the
`model.` prefix and call the output projection `head.weight`. The newer transformers modelling file renames
most modules and stacks the routed experts: `mlp.experts.gate_up_proj` [E, 2I, D] holds every expert's w1
rows, then its w3 rows, and `mlp.experts.down_proj` [E, D, I] every w2. See docs/deepseek_v41_reference.md §2.

FP8/FP4 storage (native `.scale` tensors) is not mapped here; such weights fail in the loader as before.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from deepinfer_core.model.config_v41 import DeepseekV41Config
from deepinfer_core.model.loader import Spellings, StoredTensor

__all__ = ["native_name", "new_transformers_name", "v41_spellings"]

_LAYER = r"^model\.layers\.(\d+)\."

# Our name -> newer transformers name, applied in order (§2.3). Every rule is anchored to its module, so
# `engram.wkv` keeps its name while attention's and the compressor's `wkv` become `kv_proj`.
_NEW_TRANSFORMERS_RENAMES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), replacement)
    for pattern, replacement in (
        (r"^model\.embed\.weight$", "model.embed_tokens.weight"),
        (_LAYER + r"engram\.embed\.weight$", r"model.engram_tables.\1.weight"),
        (r"\.attn_norm\.weight$", ".input_layernorm.weight"),
        (r"\.ffn_norm\.weight$", ".post_attention_layernorm.weight"),
        (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
        (r"\.attn\.attn_sink$", ".attn.sinks"),
        (r"\.attn\.wq_a\.", ".attn.q_a_proj."),
        (r"\.attn\.q_norm\.", ".attn.q_a_norm."),
        (r"\.attn\.(indexer\.)?wq_b\.", r".attn.\1q_b_proj."),
        (r"\.attn\.(compressor\.)?wkv\.", r".attn.\1kv_proj."),
        (r"\.attn\.compressor\.norm\.", ".attn.compressor.kv_norm."),
        (r"\.attn\.compressor\.wgate\.", ".attn.compressor.gate_proj."),
        (r"\.attn\.wo_(a|b)\.", r".attn.o_\1_proj."),
        (r"\.attn\.indexer\.wk\.", ".attn.indexer.k_proj."),
        (r"\.attn\.", ".self_attn."),
        (r"\.ffn\.gate\.bias(_vl)?$", r".ffn.gate.e_score_correction_bias\1"),
        (r"\.ffn\.shared_experts\.w1\.", ".ffn.shared_experts.gate_proj."),
        (r"\.ffn\.shared_experts\.w3\.", ".ffn.shared_experts.up_proj."),
        (r"\.ffn\.shared_experts\.w2\.", ".ffn.shared_experts.down_proj."),
        (r"\.ffn\.", ".mlp."),
    )
)
_ROUTED_EXPERT = re.compile(_LAYER + r"ffn\.experts\.(\d+)\.(w1|w2|w3)\.weight$")


def native_name(name: str) -> str:
    """Our name as DeepSeek's native checkpoints spell it."""
    return "head.weight" if name == "lm_head.weight" else name.removeprefix("model.")


def new_transformers_name(name: str) -> str:
    """Our name as the newer transformers modelling file spells it (routed experts aside: they are stacked)."""
    for pattern, replacement in _NEW_TRANSFORMERS_RENAMES:
        name = pattern.sub(replacement, name)
    return name


def _new_transformers_tensor(name: str, config: DeepseekV41Config) -> StoredTensor:
    expert = _ROUTED_EXPERT.match(name)
    if expert is None:
        return StoredTensor(new_transformers_name(name))
    layer, e, which = expert[1], int(expert[2]), expert[3]
    prefix = f"model.layers.{layer}.mlp.experts"
    experts, inner, d = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
    if which == "w2":
        return StoredTensor(f"{prefix}.down_proj", (e,), (experts, d, inner))  # [E, D, I] -> [D, I]
    rows = slice(0, inner) if which == "w1" else slice(inner, 2 * inner)
    return StoredTensor(f"{prefix}.gate_up_proj", (e, rows), (experts, 2 * inner, d))  # [E, 2I, D] -> [I, D]


def v41_spellings(config: DeepseekV41Config) -> Spellings:
    """For the loader: each of our names as stored under our spelling, the native one, then the newer
    transformers one (a checkpoint may mix them; each tensor is looked up on its own)."""

    def spellings(name: str) -> Sequence[StoredTensor]:
        return StoredTensor(name), StoredTensor(native_name(name)), _new_transformers_tensor(name, config)

    return spellings
