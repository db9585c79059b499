"""DeepSeek-V4.1 config parsing: the released defaults and schedule, the scaled schedules, both config.json
shapes, the per-layer plans, and every refusal naming the field at fault."""

from __future__ import annotations

import math

import pytest

from deepinfer_core.errors import DeepInferError
from deepinfer_core.model.config import ConfigError
from deepinfer_core.model.config_v41 import DeepseekV41Config
from deepinfer_core.model.v41_schedule import default_compress_ratios

RELEASED_YARN = {
    "rope_type": "yarn",
    "factor": 16,
    "beta_fast": 32,
    "beta_slow": 1,
    "original_max_position_embeddings": 65536,
}

# 5 layers, two groups (ratio 2 from layer 1, ratio 1 from layer 3), engram on layers 0 and 2 with the
# smallest prime layout of the notes (§8): primes 11,13 | 17,19 (sum 60) and 23,29 | 31,37 (sum 120).
TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "head_dim": 32,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "index_n_heads": 2,
    "index_head_dim": 32,
    "index_topk": 4,
    "o_groups": 2,
    "o_lora_rank": 8,
    "moe_intermediate_size": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "compress_ratios": [0, 2, 2, 1, 1],
    "kv_source_layer_ids": [1, 3],
    "index_source_layer_ids": [1, 3],
    "num_nextn_predict_layers": 0,
    "engram_layer_ids": [0, 2],
    "engram_vocab_size": 11,
    "engram_num_embeddings": [60, 120],
    "engram_max_ngram_size": 3,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_compressed_vocab_size": 50,
    "rope_scaling": {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 64},
    "max_position_embeddings": 256,
}


def tiny(**changes) -> dict:
    return {**TINY, **changes}


def naive_is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


# ---- the released model ----------------------------------------------------------------------------


def test_defaults_are_the_released_schedule():
    config = DeepseekV41Config.from_hf({"model_type": "deepseek_v41"})
    assert config.num_hidden_layers == 40 and config.num_nextn_predict_layers == 3
    assert config.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    assert config.kv_source_layer_ids == (2, 8, 14, 20)
    assert config.index_source_layer_ids == (2, 8, 14, 20, 24, 28, 32, 36)
    assert config.candidate_source_layer_id == 20
    assert config.dspark_target_layer_ids == (37, 38, 39)
    assert config.layer_types[:3] == ("sliding_attention", "sliding_attention", "shared_compressed_attention")
    assert [i for i, t in enumerate(config.layer_types) if t == "shared_compressed_attention"] == [2, 8, 14, 20]
    assert config.rms_norm_eps == 1e-20
    assert config.n_shared_experts == 1 and config.index_n_heads == 32 and config.gate_temp == 1.0
    assert config.eos_token_ids == (1,) and config.engram_layer_ids == () and config.engram_num_embeddings == ()
    assert (config.rope_main.theta, config.rope_main.kind) == (10000.0, "default")
    assert (config.rope_compress.theta, config.rope_compress.kind) == (160000.0, "default")
    assert config.ignored_fields == ()


def test_released_engram_tables_fit_their_primes():
    config = DeepseekV41Config.from_hf(
        {"engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682], "rope_scaling": RELEASED_YARN}
    )
    primes = config.engram_primes()
    assert [sum(map(sum, layer)) for layer in primes] == [384006168, 384016682]
    flat = [p for layer in primes for order in layer for p in order]
    assert len(flat) == 48 and len(set(flat)) == 48 and all(naive_is_prime(p) for p in flat[:8])
    smallest = [p for p in range(16_000_000, 16_000_400) if naive_is_prime(p)][:8]
    assert primes[0][0] == smallest  # layer 1's 2-grams take the 8 smallest primes >= engram_vocab_size
    assert config.rope_compress.kind == "yarn" and config.rope_compress.attention_factor == 1.0
    assert config.rope_compress.factor == 16 and config.rope_compress.theta == 160000.0
    assert config.rope_main.kind == "default" and config.rope_main.theta == 10000.0


def test_released_layer_roles():
    layers = DeepseekV41Config.from_hf({}).layers
    assert len(layers) == 40
    assert [p.rope for p in layers[:3]] == ["main", "main", "compress"] and layers[0].kv_source is None
    assert [p.layer for p in layers if p.owns_index_keys] == [2, 8, 14, 20]
    assert [p.layer for p in layers if p.reindex] == [24, 28, 32, 36]
    assert [p.layer for p in layers if p.uses_candidates] == [24, 28, 32, 36]
    assert [p.layer for p in layers if p.is_candidate_source] == [20]
    assert (layers[19].kv_source, layers[19].index_source, layers[19].ratio) == (14, 14, 2)
    assert (layers[23].kv_source, layers[23].index_source) == (20, 20)
    assert (layers[25].kv_source, layers[25].index_source, layers[25].ratio) == (20, 24, 1)
    assert (layers[39].kv_source, layers[39].index_source) == (20, 36)


@pytest.mark.parametrize(
    "n, ratios, kv",
    [(4, (0, 0, 2, 1), (2, 3)), (5, (0, 0, 2, 2, 1), (2, 4)), (6, (0, 0, 2, 2, 1, 1), (2, 4))],
)
def test_scaled_default_schedules(n, ratios, kv):
    assert default_compress_ratios(n) == ratios
    config = DeepseekV41Config.from_hf({"num_hidden_layers": n, "num_nextn_predict_layers": 0})
    assert config.compress_ratios == ratios
    assert config.kv_source_layer_ids == config.index_source_layer_ids == kv
    assert config.candidate_source_layer_id == kv[-1]


def test_draft_layers_are_padded_with_ratio_zero():
    config = DeepseekV41Config.from_hf(tiny(num_nextn_predict_layers=2))
    assert config.compress_ratios == (0, 2, 2, 1, 1, 0, 0) and len(config.layers) == 5
    assert DeepseekV41Config.from_hf(tiny(num_nextn_predict_layers=2, compress_ratios=[0, 2, 2, 1, 1, 0]))


# ---- the two config.json shapes ----------------------------------------------------------------------


def test_composite_and_flat_configs_parse_alike():
    quant = {"quant_method": "fp8", "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    composite = DeepseekV41Config.from_hf(
        {
            "architectures": ["DeepseekV41ForCausalLM"],
            "model_type": "deepseek_v41",
            "text_config": {**TINY, "model_type": "deepseek_v41_text"},
            "vision_config": {"hidden_size": 1024, "patch_size": 14},
            "image_token_id": 129264,
            "quantization_config": quant,
            "tie_word_embeddings": False,
        }
    )
    flat = DeepseekV41Config.from_hf({**TINY, "model_type": "deepseek_v41_text", "quantization_config": quant})
    untyped = DeepseekV41Config.from_hf({**TINY, "quantization_config": quant})
    assert composite == flat == untyped
    assert composite.expert_dtype == "fp4" and composite.ignored_fields == ()
    assert composite.vocab_size == 64 and composite.compress_ratios == (0, 2, 2, 1, 1)


def test_unknown_keys_are_ignored_and_listed():
    config = DeepseekV41Config.from_hf({"model_type": "deepseek_v41", "text_config": tiny(foo=1), "bar": 2})
    assert config.ignored_fields == ("bar", "text_config.foo")
    assert DeepseekV41Config.from_hf(tiny(foo=1)).ignored_fields == ("foo",)


def test_aliases_and_saved_rope_parameters():
    config = DeepseekV41Config.from_hf(
        {k: v for k, v in TINY.items() if k != "n_routed_experts"} | {"num_local_experts": 4, "intermediate_size": 16}
    )
    assert config.n_routed_experts == 4 and config.moe_intermediate_size == 16
    saved = {  # as transformers saves them: kept as they are, attention_factor included or not
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 4, "original_max_position_embeddings": 64},
    }
    config = DeepseekV41Config.from_hf(tiny(rope_parameters=saved))
    assert config.rope_compress.kind == "yarn" and config.rope_compress.attention_factor is None
    assert config.rope_compress.theta == 160000.0


def test_unusual_but_legal_schedules():
    # E4: a group without an index source attends no compressed entry; its kv source need not index
    config = DeepseekV41Config.from_hf(tiny(index_source_layer_ids=[1], candidate_source_layer_id=-1))
    assert [(p.kv_source, p.index_source) for p in config.layers] == [
        (None, None),
        (1, 1),
        (1, 1),
        (3, None),
        (3, None),
    ]
    assert not any(p.uses_candidates or p.is_candidate_source for p in config.layers)
    # a sliding-only layer inside a group, and Reindex + candidates inside one group
    config = DeepseekV41Config.from_hf(
        tiny(compress_ratios=[0, 2, 1, 0, 1], kv_source_layer_ids=[1, 2], index_source_layer_ids=[1, 2, 4])
    )
    plan = config.layers
    assert plan[3].kv_source is None and plan[3].rope == "main" and plan[4].kv_source == 2
    assert plan[4].reindex and plan[4].uses_candidates and plan[2].is_candidate_source and plan[2].owns_index_keys
    assert [p.engram for p in plan] == [True, False, True, False, False]


# ---- refusals ------------------------------------------------------------------------------------------

REFUSED = [
    ("short ratios", tiny(compress_ratios=[0, 2, 2, 1]), "compress_ratios"),
    ("long ratios", tiny(compress_ratios=[0, 2, 2, 1, 1, 0]), "compress_ratios"),
    ("negative ratio", tiny(compress_ratios=[0, 2, 2, 1, -1]), "compress_ratios"),
    ("kv out of range", tiny(kv_source_layer_ids=[1, 5]), "kv_source_layer_ids"),
    ("kv unsorted", tiny(kv_source_layer_ids=[3, 1]), "kv_source_layer_ids"),
    ("kv ratio 0", tiny(kv_source_layer_ids=[0, 1, 3]), "kv_source_layer_ids"),
    ("index ratio 0", tiny(index_source_layer_ids=[0, 1, 3]), "index_source_layer_ids"),
    ("index out of range", tiny(index_source_layer_ids=[1, 3, 7]), "index_source_layer_ids"),
    (
        "index before any kv source",
        tiny(compress_ratios=[2, 2, 2, 1, 1], index_source_layer_ids=[0, 1, 3]),
        "index_source_layer_ids",
    ),
    ("candidate not an index source", tiny(candidate_source_layer_id=2), "candidate_source_layer_id"),
    ("ratio without a kv source", tiny(compress_ratios=[2, 2, 2, 1, 1]), "kv_source_layer_ids entry at or before"),
    (
        "E1 ratio differs from its source",
        tiny(kv_source_layer_ids=[1], index_source_layer_ids=[1]),
        "compress_ratios 1",
    ),
    (
        "E3 kv source without keys",
        tiny(index_source_layer_ids=[1, 4], candidate_source_layer_id=-1),
        "add 3 to index_source_layer_ids",
    ),
    ("E2 candidate user in another group", tiny(candidate_source_layer_id=1), "candidate_source_layer_id"),
    ("tiny default trap", {"num_hidden_layers": 3, "num_nextn_predict_layers": 0}, "kv_source_layer_ids"),
    ("dspark target out of range", tiny(dspark_target_layer_ids=[4, 5]), "dspark_target_layer_ids"),
    ("engram lengths", tiny(engram_num_embeddings=[60]), "engram_num_embeddings"),
    ("engram rows default to 0", tiny(engram_num_embeddings=None), "engram_num_embeddings"),
    ("engram rows not the primes", tiny(engram_num_embeddings=[60, 121]), "[60, 120]"),
    ("engram layer out of range", tiny(engram_layer_ids=[0, 5]), "engram_layer_ids"),
    ("engram max ngram", tiny(engram_max_ngram_size=1), "engram_max_ngram_size"),
    ("engram pad spelled twice", tiny(engram_pad_token_id=3), "engram_pad_token_id"),
    ("rope dims odd", tiny(qk_rope_head_dim=7), "qk_rope_head_dim"),
    ("rope dims over index_head_dim", tiny(index_head_dim=4), "index_head_dim"),
    ("rope dims over head_dim", tiny(head_dim=4), "exceeds head_dim"),
    (
        "rope factor missing",
        tiny(rope_scaling={"rope_type": "yarn"}),
        "factor >= 1 and original_max_position_embeddings in rope_scaling",
    ),
    ("rope type unknown", tiny(rope_scaling={"rope_type": "llama3"}), "rope_type 'llama3'"),
    (
        "rope partial factor",
        tiny(rope_parameters={"main": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}, "compress": {}}),
        "qk_rope_head_dim",
    ),
    ("scoring", tiny(scoring_func="relu"), "scoring_func"),
    ("experts per token", tiny(num_experts_per_tok=5), "num_experts_per_tok"),
    ("gate temperature", tiny(gate_temp=0), "gate_temp"),
    ("o groups", tiny(o_groups=3), "o_groups"),
    ("non-positive size", tiny(sliding_window=0), "sliding_window"),
    ("not an integer", tiny(num_hidden_layers="5"), "num_hidden_layers"),
    ("alias conflict", tiny(num_local_experts=8), "num_local_experts"),
    ("model type", tiny(model_type="deepseek_v4"), "model_type"),
]


@pytest.mark.parametrize("raw, field", [case[1:] for case in REFUSED], ids=[case[0] for case in REFUSED])
def test_refused_configs_name_the_field(raw, field):
    with pytest.raises(ConfigError) as info:
        DeepseekV41Config.from_hf(raw)
    assert isinstance(info.value, DeepInferError)
    assert field in str(info.value)


def test_tiny_default_trap_says_what_to_do():
    with pytest.raises(ConfigError, match="released default.*explicitly"):
        DeepseekV41Config.from_hf({"num_hidden_layers": 3, "num_nextn_predict_layers": 0})
