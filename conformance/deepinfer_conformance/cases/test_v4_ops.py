"""DeepSeek-V4's dense and MoE ops (V4_OPS) against the reference, over a grid of shapes and dtypes.

Each case first asks `suite.require` for its op (or op feature) from V4_OPS, so a backend without it skips
with its own reason. Inputs are random with fixed seeds and sized like the tiny V4 models; float outputs are
compared with `check.close` at the dtype's tolerance (scaled for the op's reduction), routing like the V3
routing case: the chosen experts per token as a set, their weights matched by expert id.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.backend.ops import RoutingConfig

DTYPES = [torch.float32, torch.bfloat16]
TOKENS = [1, 7, 64, 133]  # batch 1, ragged, a full tile, long and odd
HIDDEN = 64  # D of each hyper-connection stream
SINKHORN_ITERS = 3  # few: the comb matrix is still far from converged, so a wrong iteration count shows


def randn(*shape, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def run(backend, name, *args, **kwargs):
    """Call op `name` of `backend` with the inputs moved to its device; return the result on CPU."""
    device = backend.torch_device

    def move(a):
        return a.to(device) if isinstance(a, torch.Tensor) else a

    out = getattr(backend.ops, name)(*map(move, args), **{k: move(v) for k, v in kwargs.items()})
    return tuple(None if o is None else o.cpu() for o in out) if isinstance(out, tuple) else out.cpu()


def streams_view(tokens: int, n: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Residual streams [T, N, D] as a non-contiguous view (the contract allows views), values O(1)."""
    return randn(tokens, n, HIDDEN + 8, seed=seed, dtype=dtype)[:, :, :HIDDEN]


def mixer(n: int, form: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fn, scale, base) in float32 as the checkpoints keep them: the layer form mixes (2 + N) N ways, the
    head form N. fn has unit gain on the rms-normalised streams so the mixes are O(1) and no sigmoid or
    softmax saturates; base is non-zero, scale differs per part, so swapping parts changes the result."""
    rows = (2 + n) * n if form == "layer" else n
    fn = randn(rows, n * HIDDEN, seed=20 + n, scale=(n * HIDDEN) ** -0.5)
    scale = 1.0 + 0.5 * randn(3 if form == "layer" else 1, seed=21)
    return fn, scale, randn(rows, seed=22, scale=0.5)


@pytest.mark.parametrize("form", ["layer", "head"])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
def test_hc_pre(suite, check, tokens, dtype, n, form):
    suite.require("hc_pre")
    ours, ref = suite.pair(dtype)
    streams = streams_view(tokens, n, seed=23, dtype=dtype)
    kwargs = dict(sinkhorn_iters=SINKHORN_ITERS, eps=1e-6, norm_eps=1e-6)
    collapsed, post, comb = run(ours, "hc_pre", streams, *mixer(n, form), **kwargs)
    ref_collapsed, ref_post, ref_comb = run(ref, "hc_pre", streams, *mixer(n, form), **kwargs)
    assert collapsed.shape == (tokens, HIDDEN) and collapsed.dtype == dtype, f"{collapsed.shape}/{collapsed.dtype}"
    # collapsed: a sum of N pre-weighted streams in the streams' dtype
    check.close(collapsed, ref_collapsed, dtype, reduce_dim=n, what="collapsed stream")
    if form == "head":  # the head's mixer has no post / comb part
        assert post is None and comb is None, "the head form (fn [N, N*D]) returns (collapsed, None, None)"
        return
    assert post.shape == (tokens, n) and comb.shape == (tokens, n, n), f"post {post.shape}, comb {comb.shape}"
    assert post.dtype == comb.dtype == torch.float32, f"post {post.dtype}, comb {comb.dtype}: mixes are float32"
    # the mixes are float32 dot products over N*D; Sinkhorn then divides by sums of N
    check.close(post, ref_post, torch.float32, reduce_dim=n * HIDDEN, what="post weights")
    check.close(comb, ref_comb, torch.float32, reduce_dim=n * HIDDEN, what="comb (after Sinkhorn)")


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
def test_hc_post(suite, check, tokens, dtype, n):
    suite.require("hc_post")
    ours, ref = suite.pair(dtype)
    block_out = randn(tokens, HIDDEN, seed=30, dtype=dtype)
    streams = streams_view(tokens, n, seed=31, dtype=dtype)
    post = 2 * randn(tokens, n, seed=32).sigmoid()  # float32, as hc_pre returns them
    comb = randn(tokens, n, n, seed=33).softmax(dim=-1)  # not symmetric: comb[j, k] vs comb[k, j] differ
    actual = run(ours, "hc_post", block_out, streams, post, comb)
    assert actual.shape == (tokens, n, HIDDEN) and actual.dtype == dtype, f"{actual.shape}/{actual.dtype}"
    # a sum of n + 1 terms, each rounded to dtype (as transformers does): where they cancel, the error is an
    # ulp of the largest term, not of the result
    terms = max(float(block_out.float().abs().max()) * 2, float(streams.float().abs().max()))
    expected = run(ref, "hc_post", block_out, streams, post, comb)
    check.close(actual, expected, dtype, reduce_dim=n + 1, magnitude=terms)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("span", [4, 16])  # an HCA window of rate 4; a CSA window (2 x rate 8)
@pytest.mark.parametrize("entries", [1, 5, 67])
def test_softmax_pool(suite, check, entries, span, dtype):
    suite.require("softmax_pool")
    ours, ref = suite.pair(dtype)
    values = randn(entries, span, HIDDEN, seed=40, dtype=dtype)
    logits = randn(entries, span, HIDDEN, seed=41, scale=2.0)  # float32, like the compressors' gates
    # -inf where a slot has no token, as the compressors mask them: entry 0 lacks its first half (a CSA
    # window before the first), others lose random slots; entry 1 keeps a single slot. Those slots' values
    # are made huge, so a slot that is not dropped (or a NaN from an all -inf max) shows.
    masked = torch.rand(entries, span, generator=torch.Generator().manual_seed(42)) < 0.3
    masked[0, : span // 2] = True
    if entries > 1:
        masked[1] = True
        masked[1, span - 1] = False
    masked[masked.all(dim=1), -1] = False  # every entry keeps at least one slot
    magnitude = float(values.float().abs().max())  # outputs average these
    logits = logits.masked_fill(masked[:, :, None], float("-inf"))
    values = values.masked_fill(masked[:, :, None], 1e4)
    actual = run(ours, "softmax_pool", values, logits)
    assert actual.shape == (entries, HIDDEN) and actual.dtype == dtype, f"{actual.shape}/{actual.dtype}"
    expected = run(ref, "softmax_pool", values, logits)
    assert torch.isfinite(expected).all()
    check.close(actual, expected, dtype, reduce_dim=span, magnitude=magnitude)


LIMIT = 3.0  # 1.5 sigma of the activations below: about one in eight gates / ups is clamped


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_and_mul_limit(suite, check, tokens, dtype):
    suite.require("silu_and_mul")
    suite.require("swiglu_limit")
    ours, ref = suite.pair(dtype)
    x = randn(tokens, 2 * 96, seed=50, dtype=dtype, scale=2.0)
    x[:, 0], x[:, 96] = 8.0, -8.0  # gate and up beyond the limit in every row
    expected = run(ref, "silu_and_mul", x, limit=LIMIT)
    assert not torch.equal(expected, run(ref, "silu_and_mul", x)), "the clamp must act on these inputs"
    check.close(run(ours, "silu_and_mul", x, limit=LIMIT), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0, 1], [64, 1, 0, 70]], ids=["ragged", "one_row", "long"])
def test_expert_ffn_swiglu_limit(suite, check, dtype, counts):
    suite.require("expert_ffn")
    suite.require("swiglu_limit")
    ours, ref = suite.pair(dtype)
    experts, hidden, inner = len(counts), 64, 48
    x = randn(sum(counts), hidden, seed=51, dtype=dtype)
    w13 = randn(experts, 2 * inner, hidden, seed=52, dtype=dtype, scale=0.3)  # gate / up of std ~2.4
    w2 = randn(experts, hidden, inner, seed=53, dtype=dtype, scale=0.2)
    tokens_per_expert = torch.tensor(counts)
    args = (x, tokens_per_expert, w13, w2)
    expected = run(ref, "expert_ffn", *args, swiglu_limit=1.5)
    assert not torch.equal(expected, run(ref, "expert_ffn", *args)), "the clamp must act on these inputs"
    # the activation is rounded to dtype before the down projection: an ulp of the output's scale, as for FP8
    actual = run(ours, "expert_ffn", *args, swiglu_limit=1.5)
    check.close(actual, expected, dtype, reduce_dim=hidden, magnitude=float(expected.float().abs().max()))


def compare_routing(check, ours, ref, logits, config, bias, expert_ids=None) -> None:
    """The chosen experts per token as a set (order free) and their weights, matched by expert id."""
    our_w, our_ids = run(ours, "moe_route", logits, config, bias, expert_ids=expert_ids)
    ref_w, ref_ids = run(ref, "moe_route", logits, config, bias, expert_ids=expert_ids)
    assert our_w.shape == our_ids.shape == (logits.shape[0], config.top_k), f"{our_w.shape}, {our_ids.shape}"
    our_order, ref_order = our_ids.argsort(dim=1), ref_ids.argsort(dim=1)
    if expert_ids is not None:  # hash routing returns the experts it was given
        check.equal(our_ids.sort(dim=1).values.long(), expert_ids.sort(dim=1).values, what="the given experts")
    check.equal(our_ids.gather(1, our_order).long(), ref_ids.gather(1, ref_order).long(), what="chosen experts")
    check.close(our_w.gather(1, our_order), ref_w.gather(1, ref_order), torch.float32, what="routing weights")


V4_ROUTINGS = {
    # V4's top-k layers: greedy over bias-corrected sqrtsoftplus scores, weighted by the raw ones
    "greedy_bias": (RoutingConfig(16, 4, scoring="sqrtsoftplus", normalize=True, routed_scaling_factor=1.5), True),
    "greedy": (RoutingConfig(16, 6, scoring="sqrtsoftplus"), False),
    "noaux_tc": (
        RoutingConfig(16, 4, "noaux_tc", "sqrtsoftplus", num_groups=4, topk_groups=2, normalize=True),
        True,
    ),
}


@pytest.mark.parametrize("routing", list(V4_ROUTINGS), ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
def test_moe_route_sqrtsoftplus(suite, check, tokens, routing):
    suite.require("moe_route")
    suite.require("sqrtsoftplus_routing")
    ours, ref = suite.pair(torch.float32)
    config, biased = V4_ROUTINGS[routing]
    logits = randn(tokens, 16, seed=60, scale=2.0)
    # a bias comparable to the score spread: the chosen set differs from the one by raw score
    bias = randn(16, seed=61, scale=0.5) if biased else None
    compare_routing(check, ours, ref, logits, config, bias)


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "softmax"])
@pytest.mark.parametrize("tokens", TOKENS)
def test_moe_route_hash(suite, check, tokens, scoring):
    suite.require("moe_route")
    suite.require("hash_routing")
    if scoring == "sqrtsoftplus":
        suite.require("sqrtsoftplus_routing")
    ours, ref = suite.pair(torch.float32)
    config = RoutingConfig(16, 4, "hash", scoring, normalize=True, routed_scaling_factor=1.5)
    logits = randn(tokens, 16, seed=62, scale=2.0)
    # the token id -> experts table's rows: distinct experts per token, mostly not the best-scored ones
    # (the lowest four by logit in half the rows), so routing by score instead of by table shows
    generator = torch.Generator().manual_seed(63)
    expert_ids = torch.stack([torch.randperm(16, generator=generator)[:4] for _ in range(tokens)])
    expert_ids[::2] = logits[::2].argsort(dim=1)[:, :4]
    compare_routing(check, ours, ref, logits, config, None, expert_ids=expert_ids)
