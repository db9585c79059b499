"""Every dense and MoE op of the contract against the reference, over a grid of shapes and dtypes."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.backend.ops import BlockFP8, RoutingConfig

DTYPES = [torch.float32, torch.bfloat16]
TOKENS = [1, 7, 64, 300]  # batch 1, ragged, a full tile, long


def randn(*shape, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def run(backend, name, *args, **kwargs):
    """Call op `name` of `backend` with the inputs moved to its device; return the result on CPU."""
    device = backend.torch_device
    moved = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    out = getattr(backend.ops, name)(
        *moved, **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    )
    return tuple(o.cpu() for o in out) if isinstance(out, tuple) else out.cpu()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm(suite, check, dtype, tokens):
    suite.require("rms_norm")
    ours, ref = suite.pair(dtype)
    x, w = randn(tokens, 256, seed=1, dtype=dtype), randn(256, seed=2, dtype=dtype)
    check.close(run(ours, "rms_norm", x, w, 1e-6), run(ref, "rms_norm", x, w, 1e-6), dtype, reduce_dim=256)


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "rotate_half"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
def test_rotary(suite, check, dtype, tokens, interleaved):
    suite.require("rotary")
    ours, ref = suite.pair(dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(3))
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 64, 2).float() / 64)
    angles = torch.arange(4096).float()[:, None] * inv_freq[None, :]
    x = randn(tokens, 4, 64, seed=4, dtype=dtype)
    args = (x, positions, angles.cos(), angles.sin())
    check.close(
        run(ours, "rotary", *args, interleaved=interleaved),
        run(ref, "rotary", *args, interleaved=interleaved),
        dtype,
        reduce_dim=2,
    )


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
def test_linear(suite, check, dtype, tokens, bias):
    suite.require("linear")
    ours, ref = suite.pair(dtype)
    x, w = randn(tokens, 256, seed=5, dtype=dtype), randn(192, 256, seed=6, dtype=dtype, scale=0.1)
    b = randn(192, seed=7, dtype=dtype) if bias else None
    check.close(run(ours, "linear", x, w, b), run(ref, "linear", x, w, b), dtype, reduce_dim=256)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
def test_head_linear(suite, check, dtype, tokens):
    suite.require("head_linear")
    ours, ref = suite.pair(dtype)
    x, w = randn(tokens, 4, 48, seed=8, dtype=dtype), randn(4, 32, 48, seed=9, dtype=dtype, scale=0.2)
    check.close(run(ours, "head_linear", x, w), run(ref, "head_linear", x, w), dtype, reduce_dim=48)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_and_mul(suite, check, dtype, tokens):
    suite.require("silu_and_mul")
    ours, ref = suite.pair(dtype)
    x = randn(tokens, 2 * 96, seed=10, dtype=dtype)
    check.close(run(ours, "silu_and_mul", x), run(ref, "silu_and_mul", x), dtype)


ROUTINGS = {
    "greedy_softmax": RoutingConfig(num_experts=16, top_k=4),
    "group_limited_greedy": RoutingConfig(
        num_experts=16, top_k=4, method="group_limited_greedy", num_groups=4, topk_groups=2, routed_scaling_factor=1.5
    ),
    "noaux_tc": RoutingConfig(
        num_experts=16,
        top_k=4,
        method="noaux_tc",
        scoring="sigmoid",
        num_groups=4,
        topk_groups=2,
        normalize=True,
        routed_scaling_factor=2.5,
    ),
}


@pytest.mark.parametrize("routing", list(ROUTINGS), ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
def test_moe_route(suite, check, tokens, routing):
    suite.require("moe_route")
    ours, ref = suite.pair(torch.float32)
    config = ROUTINGS[routing]
    logits = randn(tokens, 16, seed=11, scale=2.0)
    bias = randn(16, seed=12, scale=0.5) if config.method == "noaux_tc" else None
    our_w, our_ids = run(ours, "moe_route", logits, config, bias)
    ref_w, ref_ids = run(ref, "moe_route", logits, config, bias)
    # the order of the k chosen experts is free: compare per token, sorted by expert id
    our_order, ref_order = our_ids.argsort(dim=1), ref_ids.argsort(dim=1)
    check.equal(our_ids.gather(1, our_order).long(), ref_ids.gather(1, ref_order).long(), what="chosen experts")
    check.close(our_w.gather(1, our_order), ref_w.gather(1, ref_order), torch.float32, what="routing weights")


@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("routing", list(ROUTINGS), ids=str)
def test_moe_route_planted_ties(suite, check, routing, logits_dtype):
    """Exact ties (logits from a few values; equal groups too): the contract sends them to the lower expert
    and the lower group, so the chosen experts are the same set on every backend."""
    suite.require("moe_route")
    ours, ref = suite.pair(torch.float32)
    config = ROUTINGS[routing]
    g = torch.Generator().manual_seed(21)
    logits = (torch.randint(0, 3, (37, 16), generator=g).float() * 0.5).to(logits_dtype)  # values 0, 0.5, 1
    logits[0] = 0.0  # every expert and every group ties
    bias = torch.zeros(16) if config.method == "noaux_tc" else None
    our_w, our_ids = run(ours, "moe_route", logits, config, bias)
    ref_w, ref_ids = run(ref, "moe_route", logits, config, bias)
    check.equal(our_ids.sort(dim=1).values.long(), ref_ids.sort(dim=1).values.long(), what="chosen experts")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0, 1], [64, 1, 0, 235]], ids=["ragged", "one_row", "long"])
def test_expert_ffn(suite, check, dtype, counts):
    suite.require("expert_ffn")
    ours, ref = suite.pair(dtype)
    experts, hidden, inner = len(counts), 64, 48
    x = randn(sum(counts), hidden, seed=13, dtype=dtype)
    w13 = randn(experts, 2 * inner, hidden, seed=14, dtype=dtype, scale=0.2)
    w2 = randn(experts, hidden, inner, seed=15, dtype=dtype, scale=0.2)
    tokens_per_expert = torch.tensor(counts)
    check.close(
        run(ours, "expert_ffn", x, tokens_per_expert, w13, w2),
        run(ref, "expert_ffn", x, tokens_per_expert, w13, w2),
        dtype,
        reduce_dim=hidden,
    )


def require_fp8_weights(suite) -> None:
    suite.require_declared("weight_formats", "fp8_block", why="the loader dequantizes FP8 weights for it")


def fp8_weight(*shape: int, seed: int) -> BlockFP8:
    return BlockFP8.quantize(randn(*shape, seed=seed, scale=0.2))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
def test_linear_fp8_weight(suite, check, dtype, tokens):
    """linear with a BlockFP8 weight (DeepSeek's FP8 format) against the GEMM of the dequantized weight."""
    suite.require("linear")
    require_fp8_weights(suite)
    ours, ref = suite.pair(dtype)
    weight, bias = fp8_weight(200, 384, seed=16), randn(200, seed=17, dtype=dtype)  # cropped last row block
    x = randn(tokens, 384, seed=18, dtype=dtype)
    moved = weight.to(ours.torch_device)
    actual = ours.ops.linear(x.to(ours.torch_device), moved, bias.to(ours.torch_device)).cpu()
    expected = run(ref, "linear", x, weight, bias)
    # the reference rounds the dequantized weight to the compute dtype before the GEMM; a kernel may not
    check.close(actual, expected, dtype, reduce_dim=384, magnitude=float(expected.float().abs().max()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_expert_ffn_fp8_weights(suite, check, dtype):
    suite.require("expert_ffn")
    require_fp8_weights(suite)
    ours, ref = suite.pair(dtype)
    counts = [3, 0, 40, 1]
    x = randn(sum(counts), 256, seed=19, dtype=dtype)
    w13, w2 = fp8_weight(4, 256, 256, seed=20), fp8_weight(4, 256, 128, seed=21)
    device = ours.torch_device
    actual = ours.ops.expert_ffn(x.to(device), torch.tensor(counts).to(device), w13.to(device), w2.to(device)).cpu()
    expected = run(ref, "expert_ffn", x, torch.tensor(counts), w13, w2)
    check.close(actual, expected, dtype, reduce_dim=256, magnitude=float(expected.float().abs().max()))
