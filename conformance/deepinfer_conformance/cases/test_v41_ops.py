"""DeepSeek-V4.1's dense ops (V41_OPS) against the reference, over a grid of shapes and dtypes.

Each case first asks `suite.require` for its op, so a backend without it skips with its own reason. Inputs
are random with fixed seeds and sized like the tiny models (helpers shared with the V4 cases). Float outputs
are compared with `check.close`; `round_to_format` bitwise (`check.equal`): every step of a block format's
rounding is exact or correctly rounded, so a backend's stored value is the reference's, ties included.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_conformance.cases.test_v4_ops import DTYPES, HIDDEN, SINKHORN_ITERS, TOKENS, mixer, randn, run
from deepinfer_conformance.cases.test_v4_ops import streams_view as streams_of
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
