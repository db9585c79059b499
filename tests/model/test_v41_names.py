"""DeepSeek-V4.1 checkpoints in DeepSeek's native names and in the newer transformers names load into the same
model as our fixtures (which use the first transformers file's names): each fixture is rewritten into the other
spelling, with the routed experts stacked, and must give exactly the same prefill logits. A checkpoint missing
a tensor is told which one, in its own spelling."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer_core.backend.registry import discover
from deepinfer_core.backend.resolve import resolve_backend
from deepinfer_core.backend.selection import select_backend
from deepinfer_core.engine.request import Request
from deepinfer_core.engine.runner import ModelRunner
from deepinfer_core.model import load_model, model_registry
from deepinfer_core.model.loader import CheckpointError
from deepinfer_core.model.v41_names import native_name, new_transformers_name
from deepinfer_core.sampling.params import SamplingParams

FIXTURES = Path(__file__).parents[1] / "fixtures" / "deepseek_v41"
CASES = ("engram_top1", "two_groups_candidates")
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
BLOCK = 16

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py

# Per layer, our name -> the newer transformers name (docs/deepseek_v41_reference.md §2.2), written out here
# rather than derived so that the loader's rename rules are checked against the notes. Routed experts and
# engram tables move out of this scheme (stacked / model-level) and are handled in _new_transformers.
NEW_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"hc_{site}_{part}": f"{site}_hc.{part}" for site in ("attn", "ffn") for part in ("fn", "base", "scale")},
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.indexer.weights_proj.weight",
    "attn.indexer.wk.weight": "self_attn.indexer.k_proj.weight",
    "attn.indexer.k_norm.weight": "self_attn.indexer.k_norm.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.bias_vl": "mlp.gate.e_score_correction_bias_vl",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "engram.wkv.weight": "engram.wkv.weight",  # not attention's wkv: keeps its name
    "engram.q_weight": "engram.q_weight",
    "engram.k_weight": "engram.k_weight",
}
NEW_TOP_NAMES = {
    "model.embed.weight": "model.embed_tokens.weight",
    "model.norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$")


@pytest.fixture(scope="module")
def backend():
    return resolve_backend(select_backend(discover(), "cpu"), dtype=torch.float32, block_size=BLOCK)


def _native_name(name: str) -> str:
    """DeepSeek's own names: no `model.` prefix, `head.weight`."""
    return "head.weight" if name == "lm_head.weight" else name.removeprefix("model.")


def _native(ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    renamed = {_native_name(name): tensor for name, tensor in ours.items()}
    assert len(renamed) == len(ours) and not any(n.startswith("model.") for n in renamed)
    return renamed


def _new_name(name: str) -> str:
    """One of our unstacked names as the newer transformers spell it, from the tables above."""
    if name in NEW_TOP_NAMES:
        return NEW_TOP_NAMES[name]
    layer, rest = LAYER.match(name).groups()
    if rest.startswith("engram.embed."):
        return f"model.engram_tables.{layer}.{'weight' if rest.endswith('weight') else 'weight_scale_inv'}"
    return f"model.layers.{layer}.{NEW_LAYER_NAMES[rest]}"


def _new_transformers(ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The newer transformers names; every layer's routed experts stacked into gate_up_proj [E, 2I, D]
    (w1 rows, then w3) and down_proj [E, D, I]; engram tables model-level. An unknown name fails here."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}  # layer -> w1/w2/w3 -> expert -> tensor
    for name, tensor in ours.items():
        layer_and_rest = LAYER.match(name)
        if layer_and_rest and (expert := EXPERT.match(layer_and_rest[2])):
            experts.setdefault(layer_and_rest[1], {}).setdefault(expert[2], {})[int(expert[1])] = tensor
        else:
            out[_new_name(name)] = tensor
    for layer, by_kind in experts.items():
        count = len(by_kind["w1"])
        stacked = {kind: torch.stack([by_kind[kind][e] for e in range(count)]) for kind in ("w1", "w2", "w3")}
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat([stacked["w1"], stacked["w3"]], dim=1)
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = stacked["w2"]  # [E, D, I]
    return out


def _rewrite(case: str, folder: Path, rename, drop: str | None = None) -> Path:
    """`case`'s checkpoint with its tensors renamed (minus `drop`), beside copies of its config and tokenizer."""
    folder.mkdir()
    for side in SIDE_FILES:
        shutil.copy(FIXTURES / case / side, folder / side)
    tensors = rename(load_file(FIXTURES / case / "model.safetensors"))
    if drop is not None:
        del tensors[drop]
    save_file({n: t.contiguous() for n, t in tensors.items()}, folder / "model.safetensors")
    return folder


@torch.inference_mode()
def _prefill_logits(folder: Path, backend, prompt: list[int]) -> torch.Tensor:
    """Logits [T, V] of one prefill of `prompt` on the model loaded from `folder`."""
    model = load_model(folder, backend, model_registry(), progress=False)
    runner = ModelRunner(model, backend, num_blocks=8, num_seq_slots=1)
    for cache in (c for layer in runner.caches for c in layer.values()):
        cache.zero_()
    request = Request("0", None, list(prompt), SamplingParams(), seed=0, arrival=0)
    request.block_ids = list(range(-(-len(prompt) // BLOCK)))
    request.seq_slot = 0
    batch = runner.prepare([(request, len(prompt))])
    meta = replace(batch.meta, needed_from=None)  # every row's logits
    return model.logits(model.forward(batch.token_ids, batch.positions, meta, runner.caches))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("layout", [_native, _new_transformers], ids=["native", "new_transformers"])
def test_other_spellings_load_the_same_model(case, layout, backend, tmp_path):
    prompt = max(json.loads((FIXTURES / case / "reference.json").read_text())["prefill"]["prompts"], key=len)
    want = _prefill_logits(FIXTURES / case, backend, prompt)
    got = _prefill_logits(_rewrite(case, tmp_path / case, layout), backend, prompt)
    assert torch.equal(got, want)


@pytest.mark.parametrize("case", CASES)
def test_rename_rules_agree_with_the_tables(case):
    """Name by name, not only through a load: a wrong rule for a name every spelling shares (engram.wkv)
    would still load, through our own spelling."""
    for name in load_file(FIXTURES / case / "model.safetensors"):
        if name.endswith("engram.embed.scale") or EXPERT.match(name.split(".", 3)[-1]):
            continue  # the scale is not loaded; the experts are stacked (the load tests cover them)
        assert new_transformers_name(name) == _new_name(name), name
        assert native_name(name) == _native_name(name), name


def test_new_transformers_layout_is_what_the_notes_list():
    """The rewritten fixture has exactly the kinds of names §2.2 lists: a spot check of the test's own table."""
    names = set(_new_transformers(load_file(FIXTURES / "engram_top1" / "model.safetensors")))
    for name in (
        "model.embed_tokens.weight",
        "model.engram_tables.2.weight",
        "model.layers.2.engram.wkv.weight",
        "model.layers.1.self_attn.compressor.gate_proj.weight",
        "model.layers.0.attn_hc.fn",
        "model.layers.0.mlp.gate.e_score_correction_bias",
        "model.layers.0.mlp.experts.gate_up_proj",
    ):
        assert name in names
    assert not any(".attn." in n or ".ffn." in n or ".experts.0." in n for n in names)


@pytest.mark.parametrize(
    ("layout", "drop"),
    [
        (_native, "layers.1.attn.wq_a.weight"),
        (_native, "head.weight"),
        (_new_transformers, "model.layers.1.self_attn.compressor.kv_proj.weight"),
        (_new_transformers, "model.layers.0.mlp.experts.gate_up_proj"),  # every expert's w1 and w3 at once
        (_new_transformers, "model.engram_tables.2.weight"),
    ],
)
def test_a_missing_tensor_is_named_as_the_checkpoint_spells_it(layout, drop, backend, tmp_path):
    folder = _rewrite("engram_top1", tmp_path / "ckpt", layout, drop=drop)
    with pytest.raises(CheckpointError, match=re.escape(drop)) as info:
        load_model(folder, backend, model_registry(), progress=False)
    assert "is missing 1 tensor(s) the model needs" in str(info.value)


def test_a_stack_of_other_sizes_is_refused_though_its_slices_fit(backend, tmp_path):
    """Expert 0's w1 and w3 would still slice to [I, D] out of a [E, 3I, D] stack: the stack is checked whole."""

    def padded(ours):
        tensors = _new_transformers(ours)
        name = "model.layers.0.mlp.experts.gate_up_proj"
        tensors[name] = torch.cat([tensors[name], tensors[name][:, :16]], dim=1)  # [5, 32, 48] -> [5, 48, 48]
        return tensors

    folder = _rewrite("engram_top1", tmp_path / "ckpt", padded)
    message = "gate_up_proj in model.safetensors has shape (5, 48, 48), but the config implies (5, 32, 48)"
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_model(folder, backend, model_registry(), progress=False)
