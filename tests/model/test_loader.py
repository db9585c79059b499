"""The checkpoint loader and config parsing, on tiny DeepSeek checkpoints written by the tests.

Covers single-file vs sharded safetensors, DeepSeek's official block-FP8 format (quantized here from a
float32 checkpoint, with shapes that are not multiples of the 128 block so the crop path runs), bf16
loading with float32 router weights, every loader error, V2-style and DeepSeek-official config spellings,
and the progress bar switch.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from deepinfer_core.backend.ops import AttentionMetadata, RoutingConfig
from deepinfer_core.backend.registry import discover
from deepinfer_core.backend.resolve import resolve_backend
from deepinfer_core.backend.selection import select_backend
from deepinfer_core.errors import DeepInferError
from deepinfer_core.kv.caches import allocate_caches
from deepinfer_core.model import load_model, model_registry
from deepinfer_core.model.config import ConfigError, DeepseekConfig, RopeConfig
from deepinfer_core.model.deepseek_v3 import FLOAT32_WEIGHTS, DeepseekV3Model, expected_weights
from deepinfer_core.model.loader import INDEX_FILE, CheckpointError, dequantize_fp8_blocks, load_tensors, read_config

FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = 128

# hidden 192, q_lora 160, kv_b 128x64, o_proj 192x64, experts 96x192, dense 320x192: most projection
# shapes are not multiples of 128, so FP8 scale grids get cropped on rows, columns or both.
V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 256,
    "hidden_size": 192,
    "intermediate_size": 320,
    "moe_intermediate_size": 96,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "num_attention_heads": 2,
    "q_lora_rank": 160,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "max_position_embeddings": 128,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}

FP8_QUANT_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}

PROMPT = [3, 17, 42, 99, 7, 250, 128, 64, 5, 11, 200, 31]


# ---- checkpoint building ------------------------------------------------------------------------


def make_weights(raw: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 weights for every tensor the config implies. Matrices get a smooth row/column
    magnitude profile so FP8 blocks have clearly different scales (a mis-indexed scale shows)."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_weights(DeepseekConfig.from_hf(raw)).items():
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("e_score_correction_bias"):
            weights[name] = 0.01 * torch.randn(shape, generator=g)
        else:
            t = 0.02 * torch.randn(shape, generator=g)
            if t.ndim == 2:
                t = t * torch.linspace(1.0, 2.0, shape[0])[:, None] * torch.linspace(1.0, 2.0, shape[1])[None, :]
            weights[name] = t
    return weights


def is_fp8_target(name: str, tensor: torch.Tensor) -> bool:
    """What DeepSeek quantizes: 2-D linear projections; not norms, router gate, embeddings or lm_head."""
    return tensor.ndim == 2 and (name.endswith("_proj.weight") or name.endswith("_proj_with_mqa.weight"))


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's official block FP8: per [128, 128] block scale = amax / 448, stored = w / scale."""
    rows, cols = weight.shape
    scale_inv = torch.empty(math.ceil(rows / BLOCK), math.ceil(cols / BLOCK), dtype=torch.float32)
    stored = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            r, c = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            block = weight[r, c]
            scale = block.abs().max() / FP8_MAX
            scale = scale if scale > 0 else torch.tensor(1.0)
            scale_inv[i, j] = scale
            stored[r, c] = (block / scale).to(torch.float8_e4m3fn)
    return stored, scale_inv


def manual_dequant(stored: torch.Tensor, scale_inv: torch.Tensor, block=(BLOCK, BLOCK)) -> torch.Tensor:
    """Block by block, independently of the loader's repeat_interleave."""
    out = torch.empty(stored.shape, dtype=torch.float32)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            r, c = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            out[r, c] = stored[r, c].float() * scale_inv[i, j]
    return out


def quantize_checkpoint(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in weights.items():
        if is_fp8_target(name, t):
            out[name], out[name + "_scale_inv"] = quantize_fp8(t)
        else:
            out[name] = t
    return out


def write_checkpoint(path: Path, raw: dict, tensors: dict[str, torch.Tensor], shards: int = 1) -> Path:
    """config.json plus model.safetensors, or `shards` files and model.safetensors.index.json."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    if shards == 1:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
        return path
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[s::shards]}
        save_file(part, str(path / file))
        weight_map.update(dict.fromkeys(part, file))
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


# ---- running a loaded model ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def backends():
    """dtype -> the reference (cpu) backend resolved for it, 16-token KV blocks."""
    discovery = discover()
    entry = select_backend(discovery, "cpu")
    cache = {}

    def get(dtype: torch.dtype = torch.float32):
        if dtype not in cache:
            cache[dtype] = resolve_backend(entry, dtype=dtype, block_size=16)
        return cache[dtype]

    return get


def prefill_logits(model, backend, tokens: list[int]) -> torch.Tensor:
    """Logits [T, V] float32 of one prompt run as a single prefill."""
    n = len(tokens)
    size = backend.kv_layout.block_size
    blocks = -(-n // size)
    caches = allocate_caches(backend.kv_layout, model.cache_specs, blocks, 1)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, n]),
        seq_lens=torch.tensor([n]),
        block_tables=torch.arange(blocks)[None, :],
        slot_mapping=torch.arange(n),
    )
    with torch.inference_mode():
        hidden = model.forward(torch.tensor(tokens), torch.arange(n), meta, caches)
        return model.logits(hidden)


def load(path: Path, backend, progress: bool = False):
    return load_model(path, backend, model_registry(), progress=progress)


def load_raw_tensors(path: Path, dtype=torch.float32, progress: bool = False) -> dict[str, torch.Tensor]:
    raw = read_config(path)
    expected = expected_weights(DeepseekConfig.from_hf(raw))
    return load_tensors(path, raw, expected, dtype, FLOAT32_WEIGHTS, progress)


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return make_weights(V3_CONFIG)


@pytest.fixture(scope="module")
def single_ckpt(tmp_path_factory, weights) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("single"), V3_CONFIG, weights)


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory, weights) -> Path:
    raw = {**V3_CONFIG, "quantization_config": FP8_QUANT_CONFIG}
    return write_checkpoint(tmp_path_factory.mktemp("fp8"), raw, quantize_checkpoint(weights), shards=2)


# ---- single file vs sharded -----------------------------------------------------------------------


def test_single_file_loads_exactly_what_was_written(single_ckpt, weights):
    loaded = load_raw_tensors(single_ckpt)
    assert loaded.keys() == weights.keys()
    for name, t in weights.items():
        assert loaded[name].dtype == torch.float32, name
        assert torch.equal(loaded[name], t), name


def test_sharded_checkpoint_loads_the_same_tensors(tmp_path, single_ckpt, weights):
    extra = {**weights, "model.layers.2.eh_proj.weight": torch.ones(4, 4)}  # MTP-style extra: skipped
    sharded = write_checkpoint(tmp_path / "sharded", V3_CONFIG, extra, shards=3)
    shard_files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shard_files) == 3 and (sharded / INDEX_FILE).is_file()
    # every shard really holds model tensors (the split is not degenerate)
    index = json.loads((sharded / INDEX_FILE).read_text())["weight_map"]
    assert set(index.values()) == set(shard_files)

    single, split = load_raw_tensors(single_ckpt), load_raw_tensors(sharded)
    assert split.keys() == single.keys() == weights.keys()
    for name in single:
        assert torch.equal(split[name], single[name]), name


def test_index_is_authoritative_over_stray_files(tmp_path, weights):
    """With an index, only the shards it names are read; a stray safetensors file is ignored."""
    path = write_checkpoint(tmp_path / "ck", V3_CONFIG, weights, shards=2)
    bogus = {name: torch.zeros_like(t) for name, t in weights.items()}
    save_file(bogus, str(path / "zz-stray.safetensors"))
    loaded = load_raw_tensors(path)
    for name, t in weights.items():
        assert torch.equal(loaded[name], t), name


def test_transformers_sharded_save_matches_single_file(tmp_path, backends):
    """A checkpoint written by transformers' save_pretrained, single file and with max_shard_size,
    loads to identical tensors and identical logits."""
    transformers = pytest.importorskip("transformers")
    hf_keys = {k: v for k, v in V3_CONFIG.items() if k not in ("architectures", "topk_method", "scoring_func")}
    config = transformers.DeepseekV3Config(**hf_keys, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config)
    model.save_pretrained(tmp_path / "one", max_shard_size="1GB")
    model.save_pretrained(tmp_path / "many", max_shard_size="300KB")
    assert not (tmp_path / "one" / INDEX_FILE).exists()
    assert (tmp_path / "many" / INDEX_FILE).is_file()
    assert len(list((tmp_path / "many").glob("*.safetensors"))) >= 2

    one, many = load_raw_tensors(tmp_path / "one"), load_raw_tensors(tmp_path / "many")
    assert one.keys() == many.keys()
    for name in one:
        assert torch.equal(one[name], many[name]), name
    kv_b = "model.layers.0.self_attn.kv_b_proj.weight"
    assert torch.equal(one[kv_b], model.state_dict()[kv_b])

    backend = backends(torch.float32)
    a = prefill_logits(load(tmp_path / "one", backend), backend, PROMPT)
    b = prefill_logits(load(tmp_path / "many", backend), backend, PROMPT)
    assert a.shape == (len(PROMPT), V3_CONFIG["vocab_size"])
    assert torch.equal(a, b)


# ---- FP8 ----------------------------------------------------------------------------------------


def test_quantized_checkpoint_is_in_deepseek_format(fp8_ckpt, weights):
    """Sanity of the fixture itself: what was quantized, with which scale shapes."""
    from safetensors import safe_open

    names, dtypes, shapes = set(), {}, {}
    for file in fp8_ckpt.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            for n in f.keys():
                t = f.get_tensor(n)
                names.add(n)
                dtypes[n], shapes[n] = t.dtype, tuple(t.shape)
    quantized = {n for n in names if dtypes[n] == torch.float8_e4m3fn}
    assert len(quantized) == sum(1 for n, t in weights.items() if is_fp8_target(n, t)) > 20
    for n in quantized:
        rows, cols = shapes[n]
        assert dtypes[n + "_scale_inv"] == torch.float32
        assert shapes[n + "_scale_inv"] == (math.ceil(rows / 128), math.ceil(cols / 128))
    for n in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight", "model.norm.weight"):
        assert dtypes[n] == torch.float32
    # cropping is exercised on rows, on columns, and with several blocks per side
    assert shapes["model.layers.0.self_attn.q_a_proj.weight_scale_inv"] == (2, 2)  # 160 x 192: both cropped
    assert shapes["model.layers.0.self_attn.kv_b_proj.weight_scale_inv"] == (1, 1)  # 128 x 64
    assert shapes["model.layers.0.mlp.down_proj.weight_scale_inv"] == (2, 3)


def test_fp8_dequantization_is_exact_and_close_to_the_original(fp8_ckpt, weights):
    loaded = load_raw_tensors(fp8_ckpt)
    quantized = 0
    for name, original in weights.items():
        if not is_fp8_target(name, original):
            assert torch.equal(loaded[name], original), name
            continue
        quantized += 1
        stored, scale_inv = quantize_fp8(original)
        got = loaded[name]
        assert got.dtype == torch.float32 and got.shape == original.shape, name
        assert torch.equal(got, manual_dequant(stored, scale_inv)), name
        # e4m3 rounding: relative 2^-4 for normal values, absolute 2^-10 * scale below 2^-6 * scale
        scale = torch.kron(scale_inv, torch.ones(BLOCK, BLOCK))[: original.shape[0], : original.shape[1]]
        bound = original.abs() / 16 + scale * 2.0**-10 + 1e-12
        assert ((got - original).abs() <= bound).all(), name
        assert not torch.equal(got, original), name  # it really went through fp8
    assert quantized > 20


def test_fp8_checkpoint_logits_close_to_float32(fp8_ckpt, single_ckpt, weights, backends):
    backend = backends(torch.float32)
    ref = prefill_logits(load(single_ckpt, backend), backend, PROMPT)
    fp8 = prefill_logits(load(fp8_ckpt, backend), backend, PROMPT)
    assert torch.isfinite(fp8).all()
    assert not torch.equal(fp8, ref)
    # exactly the model of the manually dequantized weights
    dequantized = {n: manual_dequant(*quantize_fp8(t)) if is_fp8_target(n, t) else t for n, t in weights.items()}
    manual = DeepseekV3Model(DeepseekConfig.from_hf(V3_CONFIG), dequantized, backend)
    assert torch.equal(fp8, prefill_logits(manual, backend, PROMPT))
    # and close to float32: ~2.6% weight error per matrix compounds to ~8% here (MoE routing is
    # discontinuous, so a tolerance this loose is what fp8 allows, not slack)
    err = (fp8 - ref).norm() / ref.norm()
    assert err < 0.15, f"relative logits error {err:.3f}"
    cos = torch.nn.functional.cosine_similarity(fp8, ref, dim=-1)
    assert (cos > 0.98).all(), cos
    assert (fp8.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75


def test_fp8_checkpoint_loads_in_bfloat16(fp8_ckpt, weights):
    loaded = load_raw_tensors(fp8_ckpt, dtype=torch.bfloat16)
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    stored, scale_inv = quantize_fp8(weights[name])
    assert loaded[name].dtype == torch.bfloat16
    assert torch.equal(loaded[name], manual_dequant(stored, scale_inv).to(torch.bfloat16))
    assert loaded["model.layers.1.mlp.gate.weight"].dtype == torch.float32


@pytest.mark.parametrize(
    "shape, block",
    [((300, 200), (128, 128)), ((128, 256), (128, 128)), ((70, 45), (32, 16)), ((5, 7), (128, 128))],
)
def test_dequantize_fp8_blocks(shape, block):
    g = torch.Generator().manual_seed(1)
    stored = (torch.randn(shape, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    grid = (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    scale_inv = torch.rand(grid, generator=g) + 0.25  # distinct per block
    got = dequantize_fp8_blocks(stored, scale_inv, block)
    assert got.dtype == torch.float32 and got.shape == shape
    assert torch.equal(got, manual_dequant(stored, scale_inv, block))
    # spot check: element (r, c) uses scale of block (r // bn, c // bk)
    r, c = shape[0] - 1, shape[1] - 1
    assert got[r, c] == stored[r, c].float() * scale_inv[r // block[0], c // block[1]]


def test_dequantize_fp8_blocks_distinguishes_row_and_column_blocks():
    """A transposed or swapped block index would put the wrong scale on the off-diagonal blocks."""
    stored = torch.ones(256, 384, dtype=torch.float8_e4m3fn)
    scale_inv = torch.arange(1.0, 7.0).reshape(2, 3)
    got = dequantize_fp8_blocks(stored, scale_inv, (128, 128))
    assert got[0, 130].item() == 2.0 and got[130, 0].item() == 4.0 and got[255, 383].item() == 6.0


# ---- bfloat16 ----------------------------------------------------------------------------------


def test_bfloat16_load_keeps_router_in_float32(single_ckpt, weights, backends):
    loaded = load_raw_tensors(single_ckpt, dtype=torch.bfloat16)
    kept = {n for n in loaded if FLOAT32_WEIGHTS.search(n)}
    assert kept == {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"}
    for name, t in loaded.items():
        if name in kept:
            assert t.dtype == torch.float32 and torch.equal(t, weights[name]), name
        else:
            assert t.dtype == torch.bfloat16, name
            assert torch.equal(t, weights[name].to(torch.bfloat16)), name

    backend = backends(torch.bfloat16)
    model = load(single_ckpt, backend)
    moe = model.layers[1][3]
    assert model.embed.dtype == model.lm_head.dtype == torch.bfloat16
    assert moe.gate.dtype == moe.bias.dtype == torch.float32
    assert moe.w13.dtype == torch.bfloat16
    logits = prefill_logits(model, backend, PROMPT)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


# ---- errors -------------------------------------------------------------------------------------


def test_checkpoint_errors_are_deepinfer_errors():
    """The CLI prints DeepInferError messages without a traceback; CheckpointError must be one."""
    assert issubclass(CheckpointError, DeepInferError)


def test_path_not_a_directory(tmp_path, backends):
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"")
    for path in (file, tmp_path / "does-not-exist"):
        with pytest.raises(CheckpointError, match="not a directory") as info:
            load(path, backends())
        assert str(path) in str(info.value)


def test_missing_config_json(tmp_path, weights, backends):
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="no config.json"):
        load(tmp_path, backends())


def test_invalid_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_config(tmp_path)


def test_no_safetensors_files(tmp_path, backends):
    (tmp_path / "config.json").write_text(json.dumps(V3_CONFIG))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors files"):
        load(tmp_path, backends())


def test_index_naming_a_missing_shard(tmp_path, weights, backends):
    path = write_checkpoint(tmp_path / "ck", V3_CONFIG, weights, shards=3)
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors") as info:
        load(path, backends())
    message = str(info.value)
    assert INDEX_FILE in message
    assert "model-00001-of-00003" not in message and "model-00003-of-00003" not in message


def test_missing_tensor_is_named(tmp_path, weights, backends):
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    path = write_checkpoint(tmp_path / "ck", V3_CONFIG, {k: v for k, v in weights.items() if k != name})
    with pytest.raises(CheckpointError, match=re.escape(name)) as info:
        load(path, backends())
    assert "missing 1 tensor" in str(info.value)


def test_many_missing_tensors_are_summarised(tmp_path, weights):
    kept = {k: v for k, v in weights.items() if ".layers.1." not in k}
    path = write_checkpoint(tmp_path / "ck", V3_CONFIG, kept)
    missing = len(weights) - len(kept)
    with pytest.raises(CheckpointError, match=rf"missing {missing} tensor\(s\).* and {missing - 5} more"):
        load_raw_tensors(path)


def test_misshaped_tensor_names_it_and_both_shapes(tmp_path, weights, backends):
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    bad = {**weights, name: torch.zeros(128, 65)}
    path = write_checkpoint(tmp_path / "ck", V3_CONFIG, bad)
    with pytest.raises(CheckpointError) as info:
        load(path, backends())
    message = str(info.value)
    assert name in message and "(128, 65)" in message and "(128, 64)" in message


def test_misshaped_fp8_tensor_is_caught_after_dequantization(tmp_path, weights):
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors = quantize_checkpoint(weights)
    tensors[name], tensors[name + "_scale_inv"] = quantize_fp8(torch.randn(192, 96))
    path = write_checkpoint(tmp_path / "ck", {**V3_CONFIG, "quantization_config": FP8_QUANT_CONFIG}, tensors)
    with pytest.raises(CheckpointError, match=re.escape(name)) as info:
        load_raw_tensors(path)
    assert "(192, 96)" in str(info.value) and "(192, 64)" in str(info.value)


def test_unknown_architecture_lists_supported(tmp_path, weights, backends):
    path = write_checkpoint(tmp_path / "ck", {**V3_CONFIG, "architectures": ["LlamaForCausalLM"]}, weights)
    with pytest.raises(CheckpointError) as info:
        load(path, backends())
    message = str(info.value)
    assert "LlamaForCausalLM" in message
    assert "DeepseekV3ForCausalLM" in message and "DeepseekV2ForCausalLM" in message
    assert isinstance(info.value, DeepInferError)


def test_no_architecture_at_all(tmp_path, weights, backends):
    raw = {k: v for k, v in V3_CONFIG.items() if k != "architectures"}
    path = write_checkpoint(tmp_path / "ck", raw, weights)
    with pytest.raises(CheckpointError, match=r"unknown architecture \(none\)"):
        load(path, backends())


def test_fp8_weight_without_scale(tmp_path, weights):
    name = "model.layers.1.self_attn.q_b_proj.weight"
    tensors = quantize_checkpoint(weights)
    del tensors[name + "_scale_inv"]
    path = write_checkpoint(tmp_path / "ck", {**V3_CONFIG, "quantization_config": FP8_QUANT_CONFIG}, tensors)
    with pytest.raises(CheckpointError, match=re.escape(name + "_scale_inv")):
        load_raw_tensors(path)


def test_fp8_weight_without_quantization_config(tmp_path, weights):
    path = write_checkpoint(tmp_path / "ck", V3_CONFIG, quantize_checkpoint(weights))
    with pytest.raises(CheckpointError, match="is FP8 but .*quantization_config"):
        load_raw_tensors(path)


def test_unsupported_quantization_method(tmp_path, weights, backends):
    raw = {**V3_CONFIG, "quantization_config": {"quant_method": "awq", "bits": 4}}
    path = write_checkpoint(tmp_path / "ck", raw, weights)
    with pytest.raises(CheckpointError, match=r"quant_method 'awq', a quantization DeepInfer does not read"):
        load(path, backends())


@pytest.mark.parametrize("field", ["hidden_size", "kv_lora_rank", "vocab_size", "num_experts_per_tok"])
def test_config_missing_required_field(tmp_path, weights, backends, field):
    raw = {k: v for k, v in V3_CONFIG.items() if k != field}
    with pytest.raises(ConfigError, match=repr(field)):
        DeepseekConfig.from_hf(raw)
    path = write_checkpoint(tmp_path / "ck", raw, weights)
    with pytest.raises(ConfigError, match=repr(field)):
        load(path, backends())


def test_config_unknown_architecture_is_config_error():
    with pytest.raises(ConfigError, match="MistralForCausalLM.*DeepseekV3ForCausalLM"):
        DeepseekConfig.from_hf({**V3_CONFIG, "architectures": ["MistralForCausalLM"]})


def test_inconsistent_routing_is_config_error():
    with pytest.raises(ConfigError, match="routing"):
        DeepseekConfig.from_hf({**V3_CONFIG, "num_experts_per_tok": 5})


# ---- config spellings ---------------------------------------------------------------------------

V2_CONFIG = {
    **{k: v for k, v in V3_CONFIG.items() if k not in ("topk_method", "scoring_func", "norm_topk_prob")},
    "architectures": ["DeepseekV2ForCausalLM"],
    "q_lora_rank": None,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 16.0,
    "topk_method": "group_limited_greedy",
    "scoring_func": "softmax",
    "norm_topk_prob": False,
}


def test_v2_group_limited_greedy_config():
    cfg = DeepseekConfig.from_hf(V2_CONFIG)
    assert cfg.architecture == "DeepseekV2ForCausalLM"
    assert cfg.routing == RoutingConfig(
        num_experts=4,
        top_k=2,
        method="group_limited_greedy",
        scoring="softmax",
        num_groups=2,
        topk_groups=1,
        normalize=False,
        routed_scaling_factor=16.0,
    )
    assert cfg.q_lora_rank is None
    shapes = expected_weights(cfg)
    assert not any("e_score_correction_bias" in n for n in shapes)
    assert "model.layers.0.self_attn.q_proj.weight" in shapes and not any("q_a_proj" in n for n in shapes)


def test_v2_lite_style_greedy_defaults():
    """V2-Lite: greedy routing, and V2 defaults (softmax, no normalisation) when fields are absent."""
    raw = {
        k: v
        for k, v in V2_CONFIG.items()
        if k not in ("scoring_func", "norm_topk_prob", "n_group", "topk_group", "routed_scaling_factor", "topk_method")
    }
    cfg = DeepseekConfig.from_hf(raw)
    assert cfg.routing == RoutingConfig(num_experts=4, top_k=2, method="greedy", scoring="softmax", normalize=False)
    explicit = DeepseekConfig.from_hf({**raw, "topk_method": "greedy", "n_group": 1, "topk_group": 1})
    assert explicit.routing == cfg.routing
    # the same fields absent under V3 mean V3's routing
    v3 = DeepseekConfig.from_hf({**raw, "architectures": ["DeepseekV3ForCausalLM"], "n_group": 2})
    assert (v3.routing.method, v3.routing.scoring, v3.routing.normalize) == ("noaux_tc", "sigmoid", True)


def test_v2_checkpoint_loads_and_runs(tmp_path, backends):
    path = write_checkpoint(tmp_path / "v2", V2_CONFIG, make_weights(V2_CONFIG, seed=3))
    backend = backends(torch.float32)
    model = load(path, backend)
    assert model.config.routing.method == "group_limited_greedy"
    assert model.layers[1][3].bias is None
    logits = prefill_logits(model, backend, PROMPT)
    assert logits.shape == (len(PROMPT), 256) and torch.isfinite(logits).all()


YARN = {
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 16,
    "beta_slow": 2,
    "mscale": 1.0,
    "mscale_all_dim": 0.707,
}
EXPECTED_YARN = RopeConfig(
    theta=50000.0,
    kind="yarn",
    factor=40.0,
    original_max_position_embeddings=4096,
    beta_fast=16.0,
    beta_slow=2.0,
    mscale=1.0,
    mscale_all_dim=0.707,
)


def test_deepseek_rope_scaling_parses_like_transformers_rope_parameters():
    base = {k: v for k, v in V3_CONFIG.items() if k != "rope_theta"}
    official = {**base, "rope_theta": 50000.0, "rope_scaling": {"type": "yarn", **YARN}}
    hf = {**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, **YARN}}
    assert RopeConfig.from_hf(official) == EXPECTED_YARN
    assert RopeConfig.from_hf(hf) == EXPECTED_YARN
    assert DeepseekConfig.from_hf(official) == DeepseekConfig.from_hf(hf)


def test_transformers_converted_rope_config_parses_the_same():
    """transformers itself turns DeepSeek's `rope_scaling` into `rope_parameters`; both parse alike."""
    transformers = pytest.importorskip("transformers")
    official = {**V3_CONFIG, "rope_theta": 50000.0, "rope_scaling": {"type": "yarn", **YARN}}
    converted = transformers.DeepseekV3Config(**{k: v for k, v in official.items() if k != "architectures"}).to_dict()
    converted["architectures"] = ["DeepseekV3ForCausalLM"]
    assert "rope_parameters" in converted
    assert RopeConfig.from_hf(converted) == RopeConfig.from_hf(official) == EXPECTED_YARN


def test_default_rope_and_unsupported_rope():
    assert RopeConfig.from_hf({"rope_theta": 12345.0}) == RopeConfig(theta=12345.0)
    assert RopeConfig.from_hf({"rope_parameters": {"rope_type": "default", "rope_theta": 777.0}}).theta == 777.0
    with pytest.raises(ConfigError, match="'linear'"):
        RopeConfig.from_hf({"rope_scaling": {"type": "linear", "factor": 2.0}})


# ---- progress bar ------------------------------------------------------------------------------


def test_progress_bar_can_be_disabled(single_ckpt, backends, capfd):
    backend = backends(torch.float32)
    capfd.readouterr()
    load(single_ckpt, backend, progress=False)
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    load(single_ckpt, backend, progress=True)  # the switch is what silences it
    out, err = capfd.readouterr()
    assert "Loading weights" in err


def test_progress_false_is_passed_through_load_tensors(single_ckpt, capsys):
    capsys.readouterr()
    load_raw_tensors(single_ckpt, progress=False)
    assert capsys.readouterr().err == ""
    load_raw_tensors(single_ckpt, progress=True)
    assert "Loading weights" in capsys.readouterr().err


def test_unsupported_fp8_format_is_refused(tmp_path):
    import json

    import torch
    from safetensors.torch import save_file

    from deepinfer_core.model.loader import CheckpointError, load_tensors

    save_file({"w": torch.zeros(4, 4).to(torch.float8_e5m2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({}))
    with pytest.raises(CheckpointError, match="float8_e5m2; only float8_e4m3fn weights are supported"):
        load_tensors(tmp_path, {}, {"w": (4, 4)}, torch.float32, progress=False)
