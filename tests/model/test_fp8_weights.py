"""FP8 weights kept as ops.BlockFP8 for backends that compute with them: which tensors stay FP8, how the
model stacks them, and that the model computes exactly what the dequantized model computes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer_core.backend.ops import BlockFP8
from deepinfer_core.backend.weight_formats import concat_rows
from deepinfer_core.model.deepseek_v3 import FP8_WEIGHTS
from tests.model.test_loader import (  # noqa: F401  (fixtures)
    PROMPT,
    backends,
    fp8_ckpt,
    load,
    prefill_logits,
    single_ckpt,
    weights,
)


def fp8_capable(backend):
    """The reference backend declaring the fp8_block format (its ops dequantize BlockFP8 on the fly)."""
    return dataclasses.replace(
        backend, capabilities=dataclasses.replace(backend.capabilities, weight_formats=("fp8_block",))
    )


def test_fp8_weights_stay_quantized_and_compute_the_dequantized_model(fp8_ckpt, backends):  # noqa: F811
    backend = backends(torch.float32)
    kept = load(fp8_ckpt, fp8_capable(backend))
    dequantized = load(fp8_ckpt, backend)
    attention, mlp = kept.layers[1][1], kept.layers[1][3]
    assert isinstance(attention.w["o_proj.weight"], BlockFP8)
    assert isinstance(attention.w["kv_b_proj.weight"], torch.Tensor)  # split at load: always dequantized
    assert isinstance(mlp.w2, BlockFP8) and mlp.w2.weight.dtype == torch.float8_e4m3fn
    assert mlp.w2.weight.dim() == 3 and mlp.w2.scale.dim() == 3  # [E, D, I] and its block grid
    # gate | up of moe_intermediate 96 rows are not whole 128-row blocks: that stack is dequantized
    assert isinstance(mlp.w13, torch.Tensor) and mlp.w13.dtype == torch.float32
    assert torch.equal(kept.layers[1][3].gate, dequantized.layers[1][3].gate)  # the router stays float32
    assert torch.equal(prefill_logits(kept, backend, PROMPT), prefill_logits(dequantized, backend, PROMPT))


def test_backends_without_the_format_get_dequantized_tensors(fp8_ckpt, backends):  # noqa: F811
    model = load(fp8_ckpt, backends(torch.float32))
    assert not isinstance(model.layers[1][3].w13, BlockFP8)
    assert model.layers[1][3].w13.dtype == torch.float32


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.kv_b_proj.weight", "model.layers.1.mlp.gate.weight"])
def test_weights_outside_linear_are_never_kept(name):
    assert not FP8_WEIGHTS.search(name)


def test_quantize_round_trip_and_row_concatenation():
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(256, 200, generator=g), torch.randn(256, 200, generator=g)
    qg, qu = BlockFP8.quantize(gate), BlockFP8.quantize(up)
    assert qg.scale.shape == (2, 2)
    assert ((qg.dequantize() - gate).abs() <= gate.abs() / 16 + 1e-3).all()
    both = concat_rows([qg, qu], torch.float32)
    assert isinstance(both, BlockFP8) and torch.equal(both.dequantize(), torch.cat([qg.dequantize(), qu.dequantize()]))
    ragged = concat_rows([BlockFP8.quantize(gate[:100]), qu], torch.float32)  # 100 rows: not whole blocks
    assert isinstance(ragged, torch.Tensor)
    assert torch.equal(ragged, torch.cat([BlockFP8.quantize(gate[:100]).dequantize(), qu.dequantize()]))
