"""Where DeepSeek-V4.1's Engram tables live (`engram_placement`): the auto rule, host placement keeping the
loaded host tensors and giving exactly the logits of device placement, and refusals of unknown values."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from deepinfer_core.backend.registry import discover
from deepinfer_core.backend.resolve import resolve_backend
from deepinfer_core.backend.selection import select_backend
from deepinfer_core.backend.types import DeviceFacts
from deepinfer_core.engine.llm import LLM
from deepinfer_core.engine.memory import model_bytes
from deepinfer_core.errors import DeepInferError
from deepinfer_core.model import load_model, model_registry
from deepinfer_core.model.config_v41 import DeepseekV41Config
from deepinfer_core.model.deepseek_v41 import FLOAT32_WEIGHTS_V41, DeepseekV41Model, expected_weights_v41, token_map_for
from deepinfer_core.model.loader import load_tensors
from deepinfer_core.model.v41_engram import AUTO_HOST_SHARE, engram_placement
from tests.model.step_runner import garbage_runner, shuffled_requests, step_logits

CASE = Path(__file__).parents[1] / "fixtures" / "deepseek_v41" / "engram_top1"  # engram on layers 0 and 2
BLOCK, NUM_BLOCKS, SEQ_SLOTS = 16, 64, 8
GIB = 1 << 30

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py


@pytest.fixture(scope="module")
def backend():
    return resolve_backend(select_backend(discover(), "cpu"), dtype=torch.float32, block_size=BLOCK)


def _device(kind: str, total: int) -> DeviceFacts:
    return DeviceFacts(f"a {kind} device", kind, total, total)


def test_auto_keeps_the_tables_on_a_cpu_device_and_moves_large_ones_off_an_accelerator():
    huge = 203 * 10**9  # the released tables, FP8 with scales
    assert engram_placement("auto", huge, _device("cpu", 64 * GIB)) == "device"  # host and device are one memory
    accelerator = 141 * GIB
    assert engram_placement("auto", huge, _device("meta", accelerator)) == "host"
    share = int(AUTO_HOST_SHARE * accelerator)
    assert engram_placement("auto", share, _device("meta", accelerator)) == "device"
    assert engram_placement("auto", share + 1, _device("meta", accelerator)) == "host"
    assert engram_placement("host", 1, _device("cpu", accelerator)) == "host"  # asked for: as asked
    assert engram_placement("device", huge, _device("meta", accelerator)) == "device"


def test_an_unknown_placement_is_refused_with_the_choices():
    with pytest.raises(DeepInferError, match=r"engram_placement must be one of auto, host, device .*got 'gpu'"):
        engram_placement("gpu", 1, _device("cpu", GIB))
    with pytest.raises(DeepInferError, match=r"--engram-placement: where DeepSeek-V4.1's Engram tables live"):
        LLM(model=str(CASE), accelerator="cpu", engram_placement="gpu", progress=False)  # before loading


def test_the_llm_passes_the_placement_to_deepseek_v41_and_other_models_ignore_it():
    base = dict(accelerator="cpu", dtype="float32", num_kv_blocks=NUM_BLOCKS, progress=False)
    assert LLM(model=str(CASE), engram_placement="host", **base).model.engram_tables.on_host
    assert not LLM(model=str(CASE), **base).model.engram_tables.on_host  # auto, on the cpu backend
    LLM(engram_placement="host", **base)  # the demo model (DeepSeek-V4) has no Engram tables


def _logits(model, backend) -> list[torch.Tensor]:
    """A ragged prefill of three prompts, then one decode step each."""
    prompts = json.loads((CASE / "reference.json").read_text())["prefill"]["prompts"]
    requests = shuffled_requests(prompts, 5, num_blocks=NUM_BLOCKS, seq_slots=SEQ_SLOTS, block=BLOCK, spare_tokens=2)
    runner = garbage_runner(model, backend, num_blocks=NUM_BLOCKS, seq_slots=SEQ_SLOTS)
    prefill = step_logits(model, runner, [(r, len(r.prompt_token_ids) - 1) for r in requests])
    return prefill + step_logits(model, runner, [(r, 1) for r in requests])


def test_host_placement_gives_exactly_the_logits_of_device_placement(backend):
    models = {
        where: load_model(CASE, backend, model_registry(engram_placement=where), progress=False)
        for where in ("host", "device", "auto")
    }
    assert models["host"].engram_tables.on_host and not models["device"].engram_tables.on_host
    assert not models["auto"].engram_tables.on_host  # the cpu backend's device is host memory
    host, device = _logits(models["host"], backend), _logits(models["device"], backend)
    assert all(torch.equal(h, d) for h, d in zip(host, device, strict=True))


def _weights() -> tuple[DeepseekV41Config, dict[str, torch.Tensor], list[int]]:
    raw = json.loads((CASE / "config.json").read_text())
    cfg = DeepseekV41Config.from_hf(raw)
    weights = load_tensors(CASE, raw, expected_weights_v41(cfg), torch.float32, FLOAT32_WEIGHTS_V41, progress=False)
    return cfg, weights, token_map_for(cfg, CASE)


def test_host_placement_never_moves_the_tables_to_the_device(backend):
    """On a stand-in accelerator (the meta device: shapes without memory) the tables stay the loaded host
    tensors, everything else moves, the weights' device bytes leave them out, and a step's rows arrive in
    one tensor on the device."""
    cfg, weights, token_map = _weights()
    tables = [weights[f"model.layers.{i}.engram.embed.weight"] for i in cfg.engram_layer_ids]
    table_bytes = sum(t.numel() * t.element_size() for t in tables)
    small = dataclasses.replace(backend, device=_device("meta", int(table_bytes / AUTO_HOST_SHARE) - 1))
    model = DeepseekV41Model(cfg, weights, small, token_map, engram_placement="auto")  # over the share: host
    placed = model.engram_tables
    assert placed.on_host and all(got is loaded for got, loaded in zip(placed.tables, tables, strict=True))
    assert all(t.device.type == "cpu" for t in placed.tables)
    assert model.embed.device.type == "meta" and model.layers[0][4].wkv.device.type == "meta"
    assert model_bytes(model, torch.device("cpu")) == table_bytes  # the KV budget counts only the device's
    columns = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    hash_ids = torch.zeros(5, len(tables), columns, dtype=torch.int64)  # [T, L, columns]
    rows = placed.gather(hash_ids)
    assert rows.device.type == "meta" and rows.shape == (len(tables), 5, columns * cfg.engram_head_dim)

    large = dataclasses.replace(backend, device=_device("meta", int(table_bytes / AUTO_HOST_SHARE) + 1))
    on_device = DeepseekV41Model(cfg, weights, large, token_map, engram_placement="auto").engram_tables
    assert not on_device.on_host and all(t.device.type == "meta" for t in on_device.tables)
