"""Reference dense and MoE ops against independently written formulas (python loops, float64)."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer_core.backend.ops import RoutingConfig
from deepinfer_core.reference.ops import ReferenceOps

OPS = ReferenceOps()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------------------- rms_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_explicit_loop(dtype):
    g = _gen(0)
    x = (torch.randn(5, 16, generator=g) * 3).to(dtype)
    w = (torch.rand(16, generator=g) + 0.5).to(dtype)
    eps = 1e-5
    expected = torch.empty(5, 16, dtype=torch.float64)
    for t in range(5):
        row = [float(v) for v in x[t]]
        inv = 1.0 / math.sqrt(sum(v * v for v in row) / len(row) + eps)
        for d in range(16):
            expected[t, d] = row[d] * inv * float(w[d])
    out = OPS.rms_norm(x, w, eps)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, expected.to(dtype))


def test_rms_norm_eps_matters_for_tiny_inputs():
    x = torch.full((1, 4), 1e-4)
    out = OPS.rms_norm(x, torch.ones(4), eps=1e-2)
    # x / sqrt(1e-8 + 1e-2) ~= 1e-3, not 1 (which eps-free normalisation would give)
    torch.testing.assert_close(out, torch.full((1, 4), 1e-4 / math.sqrt(1e-8 + 1e-2)))


# ------------------------------------------------------------------------------------------- rotary


def _rope_tables(max_pos: int, rot_dim: int, base: float = 10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)  # [R/2]
    freqs = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]  # positions * inv_freq
    return freqs.cos().float(), freqs.sin().float(), inv_freq


def _rotary_expected(x, positions, inv_freq, interleaved):
    T, H, R = x.shape
    half = R // 2
    out = torch.empty(T, H, R, dtype=torch.float64)
    for t in range(T):
        for i in range(half):
            theta = float(positions[t]) * float(inv_freq[i])
            c, s = math.cos(theta), math.sin(theta)
            ia, ib = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
            for h in range(H):
                a, b = float(x[t, h, ia]), float(x[t, h, ib])
                out[t, h, ia] = c * a - s * b  # [[c, -s], [s, c]] @ [a, b]
                out[t, h, ib] = s * a + c * b
    return out


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_matches_per_pair_rotation(interleaved):
    g = _gen(1)
    cos, sin, inv_freq = _rope_tables(32, 8)
    positions = torch.tensor([5, 0, 17, 3, 31])
    x = torch.randn(5, 3, 8, generator=g)
    out = OPS.rotary(x, positions, cos, sin, interleaved=interleaved)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, _rotary_expected(x, positions, inv_freq, interleaved).float(), atol=1e-5, rtol=1e-5)
    # position 0 is the identity rotation
    torch.testing.assert_close(out[1], x[1])


def test_rotary_layouts_pair_different_elements():
    cos, sin, _ = _rope_tables(8, 4)
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    pos = torch.tensor([3])
    a = OPS.rotary(x, pos, cos, sin, interleaved=True)
    b = OPS.rotary(x, pos, cos, sin, interleaved=False)
    assert not torch.allclose(a, b)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_preserves_per_pair_norm(interleaved):
    g = _gen(2)
    cos, sin, _ = _rope_tables(64, 16)
    positions = torch.randint(0, 64, (6,), generator=g)
    x = torch.randn(6, 2, 16, generator=g)
    out = OPS.rotary(x, positions, cos, sin, interleaved=interleaved)

    def pair_norms(v):
        a, b = (v[..., 0::2], v[..., 1::2]) if interleaved else v.chunk(2, dim=-1)
        return a * a + b * b

    torch.testing.assert_close(pair_norms(out), pair_norms(x), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, x)  # and it did rotate something


# ----------------------------------------------------------------------------- linear, silu_and_mul


@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_dot_products(with_bias):
    g = _gen(3)
    x, w = torch.randn(4, 6, generator=g), torch.randn(5, 6, generator=g)
    bias = torch.randn(5, generator=g) if with_bias else None
    expected = torch.empty(4, 5)
    for t in range(4):
        for n in range(5):
            acc = sum(float(x[t, k]) * float(w[n, k]) for k in range(6))
            expected[t, n] = acc + (float(bias[n]) if with_bias else 0.0)
    out = OPS.linear(x, w, bias)
    assert out.shape == (4, 5)
    torch.testing.assert_close(out, expected)


def test_silu_and_mul_matches_formula():
    g = _gen(4)
    x = torch.randn(3, 10, generator=g) * 2
    expected = torch.empty(3, 5)
    for t in range(3):
        for i in range(5):
            gate, up = float(x[t, i]), float(x[t, 5 + i])
            expected[t, i] = gate / (1.0 + math.exp(-gate)) * up
    torch.testing.assert_close(OPS.silu_and_mul(x), expected)


# -------------------------------------------------------------------------------------- moe_route


def _route_one(logits, cfg, bias):
    """Independent per-token routing: returns {expert id: weight}."""
    if cfg.scoring == "sigmoid":
        scores = [1.0 / (1.0 + math.exp(-v)) for v in logits]
    else:
        m = max(logits)
        exps = [math.exp(v - m) for v in logits]
        scores = [e / sum(exps) for e in exps]
    choice = [s + (bias[e] if bias is not None else 0.0) for e, s in enumerate(scores)]
    allowed = list(range(cfg.num_experts))
    if cfg.method != "greedy" and cfg.num_groups > 1:
        size = cfg.num_experts // cfg.num_groups
        group_score = []
        for grp in range(cfg.num_groups):
            members = sorted(choice[grp * size : (grp + 1) * size], reverse=True)
            group_score.append(sum(members[:2]) if cfg.method == "noaux_tc" else members[0])
        kept = sorted(range(cfg.num_groups), key=lambda grp: -group_score[grp])[: cfg.topk_groups]
        allowed = [e for e in allowed if e // size in kept]
    ids = sorted(allowed, key=lambda e: -choice[e])[: cfg.top_k]
    weights = [scores[e] for e in ids]
    if cfg.normalize:
        total = sum(weights)
        weights = [w / total for w in weights]
    return {e: w * cfg.routed_scaling_factor for e, w in zip(ids, weights)}


def _route_actual(logits, cfg, bias=None):
    weights, ids = OPS.moe_route(logits, cfg, bias)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.shape == ids.shape == (logits.shape[0], cfg.top_k)
    return [dict(zip(i.tolist(), w.tolist())) for i, w in zip(ids, weights)]


def _check_route(logits, cfg, bias=None):
    actual = _route_actual(logits, cfg, bias)
    b = None if bias is None else bias.tolist()
    expected = [_route_one(row, cfg, b) for row in logits.double().tolist()]
    for got, want in zip(actual, expected):
        assert set(got) == set(want)
        for e in want:
            assert got[e] == pytest.approx(want[e], rel=1e-5, abs=1e-6)
    return actual


ROUTING_CASES = [
    RoutingConfig(num_experts=8, top_k=2),  # greedy / softmax
    RoutingConfig(num_experts=8, top_k=3, scoring="sigmoid", normalize=True, routed_scaling_factor=1.5),
    RoutingConfig(num_experts=16, top_k=3, method="group_limited_greedy", num_groups=4, topk_groups=2),
    RoutingConfig(
        num_experts=16,
        top_k=4,
        method="noaux_tc",
        scoring="sigmoid",
        num_groups=4,
        topk_groups=2,
        normalize=True,
        routed_scaling_factor=2.5,
    ),
]


@pytest.mark.parametrize("cfg", ROUTING_CASES, ids=lambda c: f"{c.method}-{c.scoring}")
def test_moe_route_matches_per_token_loop(cfg):
    g = _gen(5)
    logits = torch.randn(12, cfg.num_experts, generator=g) * 2
    bias = torch.randn(cfg.num_experts, generator=g) * 0.1 if cfg.method == "noaux_tc" else None
    actual = _check_route(logits, cfg, bias)
    if cfg.num_groups > 1:  # the group restriction must matter for this data, or the test proves little
        greedy = RoutingConfig(num_experts=cfg.num_experts, top_k=cfg.top_k, scoring=cfg.scoring)
        plain = _route_actual(logits, greedy, bias)
        assert any(set(a) != set(p) for a, p in zip(actual, plain))


def test_group_score_is_max_for_v2_and_top2_sum_for_v3():
    # group 0 has one strong expert (max 0.9, top-2 sum 1.05); group 1 two good ones (max 0.6, sum 1.15)
    probs = torch.tensor([[0.9, 0.15, 0.1, 0.05, 0.6, 0.55, 0.5, 0.04]], dtype=torch.float64)
    logits = torch.log(probs / (1 - probs)).float()  # sigmoid(logits) == probs
    common = dict(num_experts=8, top_k=2, scoring="sigmoid", num_groups=2, topk_groups=1)
    v2 = _check_route(logits, RoutingConfig(method="group_limited_greedy", **common))
    v3 = _check_route(logits, RoutingConfig(method="noaux_tc", **common), torch.zeros(8))
    assert set(v2[0]) == {0, 1}  # V2 keeps the group with the best single expert
    assert set(v3[0]) == {4, 5}  # V3 keeps the group with the best pair


def test_noaux_tc_bias_changes_selection_but_not_weights():
    g = _gen(6)
    cfg = RoutingConfig(num_experts=8, top_k=2, method="noaux_tc", scoring="sigmoid", num_groups=2, topk_groups=1)
    logits = torch.randn(6, 8, generator=g)
    unbiased = _check_route(logits, cfg, torch.zeros(8))
    # a strong boost for the experts that are never picked without the bias
    never = [e for e in range(8) if all(e not in row for row in unbiased)][:2] or [0, 1]
    bias = torch.zeros(8)
    bias[never] = 3.0
    biased = _check_route(logits, cfg, bias)
    assert [set(r) for r in biased] != [set(r) for r in unbiased]
    sig = logits.sigmoid()
    for t, row in enumerate(biased):  # weights are the raw sigmoid scores, not score + bias
        for e, w in row.items():
            assert w == pytest.approx(float(sig[t, e]), rel=1e-6)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_experts=8, top_k=0),
        dict(num_experts=8, top_k=9),
        dict(num_experts=8, top_k=2, num_groups=3),
        dict(num_experts=8, top_k=2, num_groups=2, topk_groups=0),
        dict(num_experts=8, top_k=2, num_groups=2, topk_groups=3),
    ],
)
def test_routing_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        RoutingConfig(**kwargs)


def test_routing_config_rejects_top_k_beyond_the_kept_groups():
    with pytest.raises(ValueError, match="top_k 4 exceeds the 2 experts left"):
        RoutingConfig(num_experts=8, top_k=4, method="group_limited_greedy", num_groups=4, topk_groups=1)
    RoutingConfig(num_experts=8, top_k=4, method="greedy", num_groups=4, topk_groups=1)  # groups unused


def test_routing_config_rejects_noaux_tc_groups_of_one():
    with pytest.raises(ValueError, match="two best experts"):
        RoutingConfig(num_experts=4, top_k=1, method="noaux_tc", num_groups=4, topk_groups=2)


# ------------------------------------------------------------------------------------- expert_ffn


def test_expert_ffn_matches_per_row_loop():
    g = _gen(7)
    E, D, I = 4, 6, 5  # noqa: E741 (I is the intermediate size, as in the papers)
    tokens_per_expert = torch.tensor([2, 0, 3, 1])  # an expert with no tokens in the middle
    x = torch.randn(6, D, generator=g)
    w13 = torch.randn(E, 2 * I, D, generator=g) / 2
    w2 = torch.randn(E, D, I, generator=g) / 2
    experts_of_rows = [e for e, n in enumerate(tokens_per_expert.tolist()) for _ in range(n)]
    expected = torch.empty(6, D, dtype=torch.float64)
    for r, e in enumerate(experts_of_rows):
        h = w13[e].double() @ x[r].double()
        gate, up = h[:I], h[I:]
        expected[r] = w2[e].double() @ (gate * torch.sigmoid(gate) * up)
    out = OPS.expert_ffn(x, tokens_per_expert, w13, w2)
    assert out.shape == (6, D) and out.dtype == x.dtype
    torch.testing.assert_close(out, expected.float())


@pytest.mark.parametrize("method", ["group_limited_greedy", "noaux_tc"])
def test_grouped_routing_of_no_tokens_is_empty(method):
    """A rank's idle forward routes no tokens through its MoE layers (parallel/lockstep.py)."""
    config = RoutingConfig(num_experts=8, top_k=2, method=method, num_groups=2, topk_groups=1)
    bias = torch.zeros(8) if method == "noaux_tc" else None
    weights, ids = OPS.moe_route(torch.empty(0, 8), config, bias)
    assert weights.shape == ids.shape == (0, 2)
