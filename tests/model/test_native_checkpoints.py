"""DeepSeek-native V4 / V4.1 checkpoints (native names, FP4 experts, E8M0 FP8 projections, FP8 Engram tables)
written by model/native_export.py: they load, hold what a backend's weight_formats ask for, and compute exactly
what their float twin computes; a checkpoint in a format DeepInfer does not read is refused by name."""

from __future__ import annotations

import dataclasses
import json
import logging
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer_conformance.tiny_v4 import TINY_V4, tiny_v4_weights
from deepinfer_core.backend.weight_formats import MXFP4, BlockFP8
from deepinfer_core.engine.llm import LLM
from deepinfer_core.errors import CheckpointError
from deepinfer_core.model.config_v41 import DeepseekV41Config
from deepinfer_core.model.demo import demo_weights_v41
from deepinfer_core.model.native_export import write_float_twin, write_native
from deepinfer_core.sampling.params import SamplingParams
from tests.model.test_loader import backends  # noqa: F401  (fixture)
from tests.model.v41_checkpoints import SCHEDULES, checkpoint_config, copy_tokenizer

V41_NATIVE = {
    **SCHEDULES["groups_and_candidates"],
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "engram_head_dim": 32,
}  # fmt: skip  (K of every expert and engram row a multiple of 32)
PROMPTS = [[5, 9, 13, 2, 7, 30, 11], [40, 3, 3, 8]]


@pytest.fixture(scope="module")
def v4_pair(tmp_path_factory):
    """(native folder, float twin folder) of the tiny V4."""
    root = tmp_path_factory.mktemp("v4-native")
    twin = write_native(root / "native", TINY_V4, tiny_v4_weights(), "v4")
    return root / "native", write_float_twin(root / "twin", TINY_V4, twin)


@pytest.fixture(scope="module")
def v41_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("v41-native")
    raw = checkpoint_config(V41_NATIVE)
    weights = demo_weights_v41(DeepseekV41Config.from_hf(raw), seed=3)
    twin = write_native(copy_tokenizer(root / "native"), raw, weights, "v41")
    return root / "native", write_float_twin(copy_tokenizer(root / "twin"), raw, twin)


def taking(backend, *formats):
    """The reference backend declaring `formats` (its ops dequantize quantized weights on the fly)."""
    return dataclasses.replace(backend, capabilities=dataclasses.replace(backend.capabilities, weight_formats=formats))


def run(path, backend, **kwargs):
    llm = LLM(model=str(path), backend=backend, progress=False, num_kv_blocks=64, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)
    outputs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    return llm, [(o.token_ids, o.top_logprobs) for o in outputs]


def test_the_native_files_hold_deepseeks_names_dtypes_and_config(v4_pair, v41_pair):
    v4 = load_file(str(v4_pair[0] / "model.safetensors"))
    assert "embed.weight" in v4 and "hc_head_fn" in v4 and "layers.0.attn.kv_norm.weight" in v4
    assert not any(name.startswith("model.") for name in v4)
    expert, scale = v4["layers.1.ffn.experts.0.w1.weight"], v4["layers.1.ffn.experts.0.w1.scale"]
    assert expert.dtype == torch.int8 and expert.shape == (32, 32) and scale.shape == (32, 2)  # [I, D/2], [I, D/32]
    assert scale.dtype == torch.float8_e8m0fnu
    assert v4["layers.1.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert v4["layers.1.attn.wq_a.scale"].shape == (1, 1)  # [32, 64] in one 128 x 128 block
    config = json.loads((v4_pair[0] / "config.json").read_text())
    assert config["expert_dtype"] == "fp4" and config["quantization_config"]["scale_fmt"] == "ue8m0"
    v41 = load_file(str(v41_pair[0] / "model.safetensors"))
    table = next(name for name in v41 if name.endswith("engram.embed.weight"))
    assert v41[table].dtype == torch.float8_e4m3fn
    assert v41[table.replace(".weight", ".scale")].shape == (v41[table].shape[0], 1)  # per 32 channels
    assert v41["layers.1.attn.wq_a.scale"].shape == (1, 2)  # V4.1: 32 x 32 blocks of [20, 64]
    assert json.loads((v41_pair[0] / "config.json").read_text())["quantization_config"]["expert_dtype"] == "fp4"


@pytest.mark.parametrize("model", ["v4", "v41"])
def test_native_checkpoints_compute_what_their_float_twin_computes(request, backends, model):  # noqa: F811
    native, twin = request.getfixturevalue(f"{model}_pair")
    cpu = backends(torch.float32)
    _, want = run(twin, cpu)
    _, dequantized = run(native, cpu)  # the cpu backend takes no quantized format: dequantized at load
    assert dequantized == want
    kept, got = run(native, taking(cpu, "fp8_block", "mxfp4"))
    assert got == want
    held = _weights_held(kept.model)
    assert MXFP4 in held and BlockFP8 in held, held


def _weights_held(model) -> set[type]:
    """The types of every weight-like attribute reachable from the model's layers (two levels down)."""
    found, seen = set(), set()

    def visit(obj, depth):
        if id(obj) in seen or depth > 4:
            return
        seen.add(id(obj))
        if isinstance(obj, (BlockFP8, MXFP4)):
            found.add(type(obj))
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item, depth + 1)
        elif isinstance(obj, dict):
            for item in obj.values():
                visit(item, depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, torch.Tensor):
            for item in vars(obj).values():
                visit(item, depth + 1)

    visit(model, 0)
    return found


def _rewrite(folder, tmp_path, edit_tensors=None, edit_config=None):
    """A copy of the checkpoint in `folder` with its tensors / config edited."""
    tensors = load_file(str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(config)
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(
    "case, match",
    [
        ("no_scale", r"layers\.1\.ffn\.experts\.0\.w1\.weight is int8 \(32, 32\) with no scales beside it"),
        ("bad_scale_fmt", r"scale_fmt 'ue4m3', a quantization DeepInfer does not read"),
        ("bad_expert_dtype", r"expert_dtype 'int4'"),
        ("unpacked", r"layers\.1\.ffn\.experts\.0\.w2\.weight is int8 .* would have to be \(64, 16\)"),
        ("byte_scales", r"scales are uint8 but .* no scale_fmt 'ue8m0'"),
        ("float_fp4_scales", r"w1\.weight's scales are float32 but FP4 \(MXFP4\) weights take E8M0"),
        ("wrong_blocks", r"wq_a\.weight \(32, 64\) has FP8 scales \(3, 3\)"),
    ],
)
def test_checkpoints_in_formats_deepinfer_does_not_read_are_refused_by_name(v4_pair, tmp_path, backends, case, match):  # noqa: F811
    expert = "layers.1.ffn.experts.0"

    def edit(tensors):
        if case == "no_scale":
            del tensors[f"{expert}.w1.scale"]
        elif case == "unpacked":
            tensors[f"{expert}.w2.weight"] = torch.zeros(64, 32, dtype=torch.int8)
        elif case == "byte_scales":
            tensors["layers.1.attn.wq_a.scale"] = tensors["layers.1.attn.wq_a.scale"].view(torch.uint8)
        elif case == "float_fp4_scales":
            tensors[f"{expert}.w1.scale"] = torch.full((32, 2), 0.3)
        elif case == "wrong_blocks":
            tensors["layers.1.attn.wq_a.scale"] = torch.ones(3, 3)

    def config(raw):
        if case == "bad_scale_fmt":
            raw["quantization_config"]["scale_fmt"] = "ue4m3"
        elif case == "bad_expert_dtype":
            raw["expert_dtype"] = "int4"
        elif case == "byte_scales":
            del raw["quantization_config"]["scale_fmt"]

    path = _rewrite(v4_pair[0], tmp_path / "bad", edit, config)
    with pytest.raises(CheckpointError, match=match):
        LLM(model=str(path), backend=backends(torch.float32), progress=False, num_kv_blocks=64)


def test_loading_logs_the_weight_bytes_by_format(v4_pair, backends, caplog):  # noqa: F811
    """What `deepinfer serve --model DIR` prints at start-up: the bytes read, by the format they are held in."""
    with caplog.at_level(logging.INFO, logger="deepinfer_core.model.loader"):
        llm = LLM(model=str(v4_pair[0]), backend=taking(backends(torch.float32), "fp8_block", "mxfp4"), progress=False,
                  num_kv_blocks=64)  # fmt: skip
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("weights read from"))
    assert _weights_held(llm.model) == {MXFP4, BlockFP8}
    sizes = dict((fmt, amount) for amount, fmt in re.findall(r"([\d.]+ [KMG]?i?B) (\w+)", line))
    assert set(sizes) == {"mxfp4", "fp8_block", "float32", "int64"}, line
    experts = load_file(str(v4_pair[0] / "model.safetensors"))
    fp4_bytes = sum(t.numel() * t.element_size() for n, t in experts.items() if ".ffn.experts." in n)
    assert sizes["mxfp4"] == f"{fp4_bytes / 1024:.2f} KiB"  # packed codes and their E8M0 scales, as stored


def test_an_int32_hash_table_routes_as_the_int64_one(v4_pair, tmp_path, backends):  # noqa: F811
    """tid2eid is int64 in the released files and an int32 parameter in DeepSeek's reference code: either loads."""

    def narrow(tensors):
        for name in [n for n in tensors if n.endswith("tid2eid")]:
            tensors[name] = tensors[name].to(torch.int32)

    path = _rewrite(v4_pair[0], tmp_path / "int32", narrow)
    assert load_file(str(path / "model.safetensors"))["layers.0.ffn.gate.tid2eid"].dtype == torch.int32
    cpu = backends(torch.float32)
    assert run(path, cpu)[1] == run(v4_pair[1], cpu)[1]


@pytest.mark.parametrize("placement", ["device", "host"])
def test_fp8_engram_tables_stay_fp8_and_give_the_dequantized_rows(v41_pair, backends, placement):  # noqa: F811
    """V4.1's Engram tables stay FP8 (half bf16's bytes) on any backend, in either placement; only the rows a step
    gathers are dequantized, to exactly what dequantizing the whole table at load gives."""
    cpu = backends(torch.float32)
    llm, got = run(v41_pair[0], cpu, engram_placement=placement)
    tables = llm.model.engram_tables
    assert tables.on_host == (placement == "host")
    assert all(isinstance(t, BlockFP8) and t.block == (1, 32) for t in tables.tables)
    assert got == run(v41_pair[1], cpu, engram_placement=placement)[1]


def test_a_sharded_native_checkpoint_finds_scales_in_other_shards(v4_pair, tmp_path, backends):  # noqa: F811
    """Shards with an index (as released): a weight's `.scale` may sit in another shard than the weight."""
    from tests.model.test_loader import INDEX_FILE, write_checkpoint

    tensors = load_file(str(v4_pair[0] / "model.safetensors"))
    config = json.loads((v4_pair[0] / "config.json").read_text())
    path = write_checkpoint(tmp_path / "sharded", config, tensors, shards=3)
    weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    expert = "layers.1.ffn.experts.0.w1"
    assert weight_map[f"{expert}.weight"] != weight_map[f"{expert}.scale"]
    cpu = backends(torch.float32)
    assert run(path, taking(cpu, "fp8_block", "mxfp4"))[1] == run(v4_pair[1], cpu)[1]
