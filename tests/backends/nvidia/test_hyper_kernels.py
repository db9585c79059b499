"""DeepSeek-V4's hyper-connection and pooling kernels (kernels.hyper) against ReferenceOps under Triton's
interpreter, on the conformance suite's grid: both mixer forms, 2 to 4 streams, ragged token counts, views,
masked pooling slots."""

from __future__ import annotations

import pytest
import torch

from deepinfer_nvidia_sm100.ops import NvidiaOps
from tests.backends.nvidia.test_dense_kernels import REF, assert_matches, randn

DTYPES = [torch.float32, torch.bfloat16]
HIDDEN = 48  # not a power of two: masked lanes


def streams_view(tokens: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return randn(tokens, n, HIDDEN + 8, dtype=dtype, seed=seed)[:, :, :HIDDEN]  # [T, N, D], a view


def mixer(n: int, form: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fn, scale, base) float32: mixes O(1), no sigmoid or softmax saturated, every part scaled differently."""
    rows = (2 + n) * n if form == "layer" else n
    fn = randn(rows, n * HIDDEN, dtype=torch.float32, seed=seed, scale=(n * HIDDEN) ** -0.5)
    scale = 1.0 + 0.5 * randn(3 if form == "layer" else 1, dtype=torch.float32, seed=seed + 1)
    return fn, scale, randn(rows, dtype=torch.float32, seed=seed + 2, scale=0.5)


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "invariant"])
@pytest.mark.parametrize("form", ["layer", "head"])
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_hc_pre(tokens, dtype, n, form, batch_invariant):
    streams = streams_view(tokens, n, dtype, seed=1)
    kwargs = dict(sinkhorn_iters=3, eps=1e-6, norm_eps=1e-6)
    collapsed, post, comb = NvidiaOps(batch_invariant).hc_pre(streams, *mixer(n, form, seed=2), **kwargs)
    ref_collapsed, ref_post, ref_comb = REF.hc_pre(streams, *mixer(n, form, seed=2), **kwargs)
    assert_matches(collapsed, ref_collapsed, reduced=n, roundings=1)
    if form == "head":
        assert post is None and comb is None
        return
    assert post.dtype == comb.dtype == torch.float32
    assert_matches(post, ref_post, reduced=n * HIDDEN)
    assert_matches(comb, ref_comb, reduced=n * HIDDEN)


def test_hc_pre_sinkhorn_iterations_count():
    """Twenty iterations (V4's) converge the comb matrix to doubly stochastic; the reference's too, alike."""
    streams = streams_view(5, 4, torch.float32, seed=3)
    kwargs = dict(sinkhorn_iters=20, eps=1e-6, norm_eps=1e-6)
    _, _, comb = NvidiaOps().hc_pre(streams, *mixer(4, "layer", seed=4), **kwargs)
    _, _, ref_comb = REF.hc_pre(streams, *mixer(4, "layer", seed=4), **kwargs)
    assert_matches(comb, ref_comb, reduced=4 * HIDDEN)
    torch.testing.assert_close(comb.sum(dim=1), torch.ones(5, 4), rtol=0, atol=1e-4)
    _, _, fewer = NvidiaOps().hc_pre(streams, *mixer(4, "layer", seed=4), **dict(kwargs, sinkhorn_iters=1))
    assert not torch.allclose(fewer, comb, atol=1e-3)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_hc_post(tokens, dtype, n):
    block_out = randn(tokens, HIDDEN + 4, dtype=dtype, seed=5)[:, :HIDDEN]
    streams = streams_view(tokens, n, dtype, seed=6)
    post = 2 * randn(tokens, n, dtype=torch.float32, seed=7).sigmoid()
    comb = randn(tokens, n, n, dtype=torch.float32, seed=8).softmax(dim=-1)  # not symmetric
    out = NvidiaOps().hc_post(block_out, streams, post, comb)
    assert_matches(out, REF.hc_post(block_out, streams, post, comb), reduced=n + 1, roundings=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("span", [4, 8, 32])
@pytest.mark.parametrize("entries", [1, 5, 19])
def test_softmax_pool(entries, span, dtype):
    values = randn(entries, span, HIDDEN, dtype=dtype, seed=9)
    logits = randn(entries, span, HIDDEN, dtype=torch.float32, seed=10, scale=2.0)
    masked = torch.rand(entries, span, generator=torch.Generator().manual_seed(11)) < 0.3
    masked[0, : span // 2] = True  # a window before the first: half its slots empty
    masked[masked.all(dim=1), -1] = False  # every entry keeps a slot
    logits = logits.masked_fill(masked[:, :, None], float("-inf"))
    values = values.masked_fill(masked[:, :, None], 1e4)  # a slot that is not dropped shows
    out = NvidiaOps().softmax_pool(values, logits)
    expected = REF.softmax_pool(values, logits)
    assert torch.isfinite(out).all()
    # the weights are rounded to the values' dtype: one ulp of the largest value, per slot
    assert_matches(out, expected, reduced=span, roundings=2)


def test_softmax_pool_on_views():
    values = randn(3, 8, HIDDEN + 16, dtype=torch.float32, seed=12)[:, :, 16:]
    logits = randn(3, 8, 2 * HIDDEN, dtype=torch.float32, seed=13)[:, :, :HIDDEN]
    assert_matches(NvidiaOps().softmax_pool(values, logits), REF.softmax_pool(values, logits), reduced=8)


def test_empty_inputs():
    ops = NvidiaOps()
    collapsed, post, comb = ops.hc_pre(
        torch.empty(0, 2, HIDDEN), *mixer(2, "layer", seed=14), sinkhorn_iters=3, eps=1e-6, norm_eps=1e-6
    )
    assert collapsed.shape == (0, HIDDEN) and post.shape == (0, 2) and comb.shape == (0, 2, 2)
    assert ops.hc_post(torch.empty(0, HIDDEN), torch.empty(0, 2, HIDDEN), post, comb).shape == (0, 2, HIDDEN)
    assert ops.softmax_pool(torch.empty(0, 4, HIDDEN), torch.empty(0, 4, HIDDEN)).shape == (0, HIDDEN)
