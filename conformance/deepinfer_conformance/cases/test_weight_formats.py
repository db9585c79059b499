"""DeepSeek's weight formats as released: FP8 with E8M0 (power-of-two) block scales (V4: 128 x 128; V4.1: 32 x 32)
and FP4 routed experts (MXFP4: e2m1 pairs, E8M0 per 32), in `linear` / `expert_ffn` for backends that declare the
format, and end to end: a tiny V4 and V4.1 checkpoint in DeepSeek's native layout (our quantizer) generates the
float32 greedy tokens of its float twin on the reference, on every backend (those without the formats get the
weights dequantized at load)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_conformance.cases.test_end_to_end import compare_float32
from deepinfer_conformance.cases.test_ops import DTYPES, randn, run
from deepinfer_core.backend.ops import MXFP4, BlockFP8


def declared(suite, fmt: str) -> None:
    suite.require_declared("weight_formats", fmt, why="the loader dequantizes these weights for it")


def on(backend, *tensors):
    return [t.to(backend.torch_device) for t in tensors]


@pytest.mark.parametrize("block", [128, 32], ids=["v4_blocks", "v41_blocks"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 64])
def test_linear_fp8_e8m0_scales(suite, check, dtype, tokens, block):
    """linear with FP8 values and E8M0 scale bytes (ue8m0) against the GEMM of the dequantized weight."""
    suite.require("linear")
    declared(suite, "fp8_block")
    ours, ref = suite.pair(dtype)
    weight = BlockFP8.quantize(randn(200, 384, seed=31, scale=0.2), (block, block), "e8m0")
    x = randn(tokens, 384, seed=32, dtype=dtype)
    actual = ours.ops.linear(*on(ours, x), weight.to(ours.torch_device)).cpu()
    expected = run(ref, "linear", x, weight)
    check.close(actual, expected, dtype, reduce_dim=384, magnitude=float(expected.float().abs().max()))


@pytest.mark.parametrize("variant", ["plain", "v4_limit", "v41_row_scales"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_expert_ffn_fp4_experts(suite, check, dtype, variant):
    """expert_ffn with MXFP4 experts (gate | up [E, 2I, D], down [E, D, I]) against the dequantized experts."""
    suite.require("expert_ffn")
    declared(suite, "mxfp4")
    ours, ref = suite.pair(dtype)
    counts = torch.tensor([3, 0, 40, 1])
    x = randn(int(counts.sum()), 256, seed=33, dtype=dtype)
    w13 = MXFP4.quantize(randn(4, 384, 256, seed=34, scale=0.2))
    w2 = MXFP4.quantize(randn(4, 256, 192, seed=35, scale=0.2))
    kwargs = {}
    if variant == "v4_limit":
        kwargs["swiglu_limit"] = 1.0
    if variant == "v41_row_scales":
        scales = 0.05 + torch.rand(int(counts.sum()), generator=torch.Generator().manual_seed(36))
        kwargs = {"swiglu_limit": 1.0, "row_scales": scales}
    device = ours.torch_device
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    actual = ours.ops.expert_ffn(*on(ours, x, counts), w13.to(device), w2.to(device), **moved).cpu()
    expected = run(ref, "expert_ffn", x, counts, w13, w2, **kwargs)
    check.close(actual, expected, dtype, reduce_dim=256, magnitude=float(expected.float().abs().max()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_expert_ffn_fp8_e8m0_v41_blocks(suite, check, dtype):
    """expert_ffn with FP8 experts in V4.1's 32 x 32 E8M0 blocks (several scales along one K tile)."""
    suite.require("expert_ffn")
    declared(suite, "fp8_block")
    ours, ref = suite.pair(dtype)
    counts = torch.tensor([5, 17, 0, 2])
    x = randn(int(counts.sum()), 256, seed=37, dtype=dtype)
    w13 = BlockFP8.quantize(randn(4, 256, 256, seed=38, scale=0.2), (32, 32), "e8m0")
    w2 = BlockFP8.quantize(randn(4, 256, 128, seed=39, scale=0.2), (32, 32), "e8m0")
    device = ours.torch_device
    actual = ours.ops.expert_ffn(*on(ours, x, counts), w13.to(device), w2.to(device)).cpu()
    expected = run(ref, "expert_ffn", x, counts, w13, w2)
    check.close(actual, expected, dtype, reduce_dim=256, magnitude=float(expected.float().abs().max()))


@pytest.mark.parametrize("family", ["v4", "v41"])
def test_native_checkpoint_greedy_float32(suite, check, native_checkpoint, family):
    """The tiny model in DeepSeek's native layout and formats on the backend under test (weights kept in the
    formats it declares, the rest dequantized at load) against its float twin on the reference: the same greedy
    tokens, top logprobs within float32 tolerance."""
    ours, ref = suite.pair(torch.float32)
    native, twin = native_checkpoint(family)
    compare_float32(check, native, ours, ref, ref_path=twin)
