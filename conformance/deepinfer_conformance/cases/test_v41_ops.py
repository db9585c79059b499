"""DeepSeek-V4.1's dense ops (V41_OPS) against the reference, over a grid of shapes and dtypes.

Each case first asks `suite.require` for its op, so a backend without it skips with its own reason. Inputs
are random with fixed seeds and sized like the tiny models (helpers shared with the V4 cases). Float outputs
are compared with `check.close`; `round_to_format` bitwise (`check.equal`): every step of a block format's
rounding is exact or correctly rounded, so a backend's stored value is the reference's, ties included.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_conformance.cases.test_ops import fp8_weight, require_fp8_weights
from deepinfer_conformance.cases.test_v4_ops import DTYPES, HIDDEN, SINKHORN_ITERS, TOKENS, mixer, randn, run
from deepinfer_conformance.cases.test_v4_ops import streams_view as streams_of
from deepinfer_conformance.harness import tolerance
from deepinfer_core.backend.ops import BLOCK_FORMATS


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
def test_hc_mixes(suite, check, tokens, dtype, n):
    suite.require("hc_mixes")
    ours, ref = suite.pair(dtype)
    streams = streams_of(tokens, n, seed=23, dtype=dtype)
    kwargs = dict(sinkhorn_iters=SINKHORN_ITERS, eps=1e-6, norm_eps=1e-20)  # V4.1's rms eps
    actual = run(ours, "hc_mixes", streams, *mixer(n, "layer"), **kwargs)
    expected = run(ref, "hc_mixes", streams, *mixer(n, "layer"), **kwargs)
    shapes = [(tokens, n), (tokens, n), (tokens, n, n)]
    assert [tuple(a.shape) for a in actual] == shapes, f"(pre, post, comb) shapes {[tuple(a.shape) for a in actual]}"
    assert all(a.dtype == torch.float32 for a in actual), f"dtypes {[a.dtype for a in actual]}: mixes are float32"
    # float32 dot products over N*D; Sinkhorn then divides by sums of N
    for what, a, e in zip(("pre weights", "post weights", "comb (after Sinkhorn)"), actual, expected):
        check.close(a, e, torch.float32, reduce_dim=n * HIDDEN, what=what)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
def test_hc_collapse(suite, check, tokens, dtype, n):
    suite.require("hc_collapse")
    ours, ref = suite.pair(dtype)
    streams = streams_of(tokens, n, seed=24, dtype=dtype)
    pre = torch.rand(tokens, n, generator=torch.Generator().manual_seed(25)) + 1e-6  # float32, as hc_mixes's
    actual = run(ours, "hc_collapse", streams, pre)
    assert actual.shape == (tokens, HIDDEN) and actual.dtype == dtype, f"{actual.shape}/{actual.dtype}"
    check.close(actual, run(ref, "hc_collapse", streams, pre), dtype, reduce_dim=n, what="collapsed stream")


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
def test_hc_expand(suite, check, tokens, dtype, n):
    suite.require("hc_expand")
    ours, ref = suite.pair(dtype)
    block_out = randn(tokens, HIDDEN, seed=30, dtype=dtype)
    streams = streams_of(tokens, n, seed=31, dtype=dtype)
    post = 2 * randn(tokens, n, seed=32).sigmoid()  # float32, as hc_mixes returns them
    comb = randn(tokens, n, n, seed=33).softmax(dim=-1)  # not symmetric: comb[j, k] vs comb[k, j] differ
    actual = run(ours, "hc_expand", block_out, streams, post, comb)
    assert actual.shape == (tokens, n, HIDDEN) and actual.dtype == dtype, f"{actual.shape}/{actual.dtype}"
    # n + 1 float32 terms, one rounding to dtype: where they cancel, the error is a float32 ulp of the largest
    terms = max(float(block_out.float().abs().max()) * 2, float(streams.float().abs().max()))
    expected = run(ref, "hc_expand", block_out, streams, post, comb)
    check.close(actual, expected, dtype, reduce_dim=n + 1, magnitude=terms)


def blocks_to_round(fmt: str, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, 4 blocks] of random values over six orders of magnitude (one scale per block), where the
    first row's blocks are the format's rounding ties: each value a tie of the element grid times a scale
    its block's amax forces (e2m1: 0.25 .. 5 halfway points; e4m3: halfway between neighbours)."""
    block = int(fmt.rsplit(":", 1)[1])
    magnitudes = torch.logspace(-3, 3, rows * 4).view(rows, 4, 1)
    x = (randn(rows, 4, block, seed=70) * magnitudes).view(rows, 4 * block)
    if fmt.startswith("fp4"):
        ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -2.5, -5.0])
        scale = 0.625 if fmt.endswith("e4m3:16") else 2.0**-3  # amax 6 * scale: that scale exactly
    else:
        ties = torch.tensor([448.0, 9.5, 10.5, 17.0, 19.0, 0.5 + 2**-5, 1.5 * 2**-9, -9.5, -25.0])  # e4m3 ties
        scale = 2.0**-5  # amax 448 * 2^-5
    x[0, : len(ties)] = ties * scale
    x[0, len(ties) : block] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_round_to_format(suite, check, rows, dtype, fmt):
    suite.require("round_to_format")
    ours, ref = suite.pair(dtype)
    x = blocks_to_round(fmt, rows, dtype)
    if rows > 1:  # also as a 3-D view: [rows, 2, 2 blocks] of a wider tensor
        x = torch.cat([x, x], dim=-1).view(rows, 4, -1)[:, ::2]
    actual = run(ours, "round_to_format", x, fmt)
    assert actual.shape == x.shape and actual.dtype == dtype, f"{actual.shape}/{actual.dtype}"
    check.equal(actual, run(ref, "round_to_format", x, fmt), what=f"{fmt} rounded values")


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
def test_engram_gate(suite, check, tokens, dtype, n):
    suite.require("engram_gate")
    ours, ref = suite.pair(dtype)
    streams = streams_of(tokens, n, seed=80, dtype=dtype)
    key = randn(tokens, n, HIDDEN, seed=81)  # float32, as the model splits it off its projection
    value = randn(tokens, HIDDEN, seed=82, dtype=dtype)
    weight = 0.5 + torch.rand(n, HIDDEN, generator=torch.Generator().manual_seed(83))
    dead = torch.rand(tokens, generator=torch.Generator().manual_seed(84)) < 0.25  # pad / image tokens
    args = (streams, key, value, weight, dead)
    actual = run(ours, "engram_gate", *args, eps=1e-20)
    assert actual.shape == streams.shape and actual.dtype == dtype, f"{actual.shape}/{actual.dtype}"
    check.equal(actual[dead], streams[dead], what="dead tokens' streams (gate 0)")
    # the gate comes from float32 dot products over D; the output adds a gated value to the stream
    magnitude = float(streams.float().abs().max()) + float(value.float().abs().max())
    expected = run(ref, "engram_gate", *args, eps=1e-20)
    check.close(actual, expected, dtype, reduce_dim=HIDDEN, magnitude=magnitude, what="streams after the engram")


# expert_ffn with row_scales (op feature "expert_row_scales"): V4.1 applies each routed expert's weight to the
# activation before w2, in float32 before its one rounding to the compute dtype

EXPERT_COUNTS = {"ragged": [3, 0, 5, 1], "one_row": [0, 0, 0, 1], "long": [64, 1, 0, 70], "idle_first": [0, 17, 2]}
ROW_SCALES_LIMIT = 1.5  # V4's swiglu_limit, low enough to clamp some of the gate / up values below


def row_scales(rows: int, seed: int) -> torch.Tensor:
    """[rows] float32 like routing weights (positive, below routed_scaling_factor), far from 1 for most rows."""
    return 0.05 + 2.0 * torch.rand(rows, generator=torch.Generator().manual_seed(seed))


def expert_args(counts: list[int], dtype: torch.dtype, seed: int, hidden: int = 64, inner: int = 48):
    """(x [N, D], tokens_per_expert [E], w13 [E, 2I, D], w2 [E, D, I]); gate / up of std ~2.4."""
    experts = len(counts)
    x = randn(sum(counts), hidden, seed=seed, dtype=dtype)
    w13 = randn(experts, 2 * inner, hidden, seed=seed + 1, dtype=dtype, scale=0.3)
    w2 = randn(experts, hidden, inner, seed=seed + 2, dtype=dtype, scale=0.2)
    return x, torch.tensor(counts), w13, w2


@pytest.mark.parametrize("limit", [None, ROW_SCALES_LIMIT], ids=["no_limit", "swiglu_limit"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("counts", EXPERT_COUNTS.values(), ids=EXPERT_COUNTS.keys())
def test_expert_ffn_row_scales(suite, check, counts, dtype, limit):
    suite.require("expert_ffn")
    suite.require("expert_row_scales")
    if limit is not None:
        suite.require("swiglu_limit")
    ours, ref = suite.pair(dtype)
    args = expert_args(counts, dtype, seed=90)
    scales = row_scales(sum(counts), seed=93)
    expected = run(ref, "expert_ffn", *args, swiglu_limit=limit, row_scales=scales)
    assert not torch.equal(expected, run(ref, "expert_ffn", *args, swiglu_limit=limit)), "the scales must act"
    actual = run(ours, "expert_ffn", *args, swiglu_limit=limit, row_scales=scales)
    assert actual.shape == expected.shape and actual.dtype == dtype, f"{actual.shape}/{actual.dtype}"
    # the scaled activation is rounded to dtype before the down projection: an ulp of the output's scale
    check.close(actual, expected, dtype, reduce_dim=64, magnitude=float(expected.float().abs().max()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_expert_ffn_row_scales_are_applied_per_row(suite, check, dtype):
    """The scales really act, each on its own row: the result is far (beyond the tolerance) from the unscaled
    one and from the one with the scales given in another row order, and a row of scale 0 gives exact zeros."""
    suite.require("expert_ffn")
    suite.require("expert_row_scales")
    ours, ref = suite.pair(dtype)
    counts = [5, 0, 9, 3]
    args = expert_args(counts, dtype, seed=94)
    scales = row_scales(sum(counts), seed=97)
    zeroed = torch.tensor([0, 6, 16])  # the first row of experts 0, 2 and 3
    scales[zeroed] = 0.0
    actual = run(ours, "expert_ffn", *args, row_scales=scales)
    magnitude = float(actual.float().abs().max())
    rtol, atol = tolerance(dtype, 64)
    atol = max(atol, torch.finfo(dtype).eps * magnitude)  # as check.close allows
    for what, other in (("unscaled", None), ("scales in reverse row order", scales.flip(0))):
        assert not torch.allclose(
            actual.float(), run(ours, "expert_ffn", *args, row_scales=other).float(), rtol=rtol, atol=atol
        ), f"expert_ffn with row_scales is within the tolerance of the result with {what}: were they applied?"
    check.equal(actual[zeroed], torch.zeros(len(zeroed), actual.shape[1], dtype=dtype), what="rows of scale 0")
    expected = run(ref, "expert_ffn", *args, row_scales=scales)
    check.close(actual, expected, dtype, reduce_dim=64, magnitude=float(expected.float().abs().max()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_expert_ffn_row_scales_fp8_weights(suite, check, dtype):
    suite.require("expert_ffn")
    suite.require("expert_row_scales")
    require_fp8_weights(suite)
    ours, ref = suite.pair(dtype)
    counts = [3, 0, 40, 1]
    x = randn(sum(counts), 256, seed=98, dtype=dtype)
    w13, w2 = fp8_weight(4, 256, 256, seed=99), fp8_weight(4, 256, 128, seed=100)
    scales = row_scales(sum(counts), seed=101)
    device = ours.torch_device
    actual = ours.ops.expert_ffn(
        x.to(device), torch.tensor(counts).to(device), w13.to(device), w2.to(device), row_scales=scales.to(device)
    ).cpu()
    expected = run(ref, "expert_ffn", x, torch.tensor(counts), w13, w2, row_scales=scales)
    check.close(actual, expected, dtype, reduce_dim=256, magnitude=float(expected.float().abs().max()))
