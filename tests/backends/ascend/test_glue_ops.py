"""AscendOps against ReferenceOps, op by op, in float32 and bfloat16, on fresh random inputs.

These are glue tests on CPU against a fake torch_npu written from its documentation — not evidence that the
backend runs on Ascend hardware. They check what the backend does around each torch_npu call (argument
names and values, layouts, dtypes, views) and that the documented op semantics give the contract's result.
"""

from __future__ import annotations

import pytest
import torch
from fake_torch_npu import FakeTorchNpu

from deepinfer_ascend950.ops import AscendOps
from deepinfer_core.backend.ops import RoutingConfig
from deepinfer_core.reference.ops import ReferenceOps

DTYPES = [torch.float32, torch.bfloat16]
REF = ReferenceOps()


def randn(*shape: int, dtype=torch.float32, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def assert_matches(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: a few float32 ulps; bfloat16: a couple of bfloat16 roundings of the largest value."""
    assert out.shape == expected.shape and out.dtype == expected.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    else:
        ulp = torch.finfo(torch.bfloat16).eps * expected.float().abs().max().item()
        torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2 * ulp)


@pytest.fixture
def npu() -> FakeTorchNpu:
    return FakeTorchNpu()


@pytest.mark.parametrize("view", [False, True], ids=["contiguous", "column_slice"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(npu, dtype, view):
    x = randn(9, 80, dtype=dtype, seed=1)
    x = x[:, :64] if view else x[:, :64].contiguous()  # MLA normalises the latent slice of kv_a's output
    weight = randn(64, dtype=dtype, seed=2, scale=0.5) + 1
    out = AscendOps(npu).rms_norm(x, weight, 1e-6)
    assert_matches(out, REF.rms_norm(x, weight, 1e-6), dtype)
    [call] = npu.calls_of("npu_rms_norm")
    assert call.args["epsilon"] == 1e-6


def _rope_tables(max_pos: int, half: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(max_pos, half, generator=torch.Generator().manual_seed(seed)) * 6.3
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("source", ["q_pe", "k_pe"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleave", "half"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_on_views(npu, dtype, interleaved, source):
    tokens, heads, nope, rope = 7, 3, 24, 16
    if source == "q_pe":  # q[..., nope:] of q [T, H, nope + R]
        x = randn(tokens, heads, nope + rope, dtype=dtype, seed=3)[..., nope:]
    else:  # kv[:, None, C:] of kv_a's output [T, C + R]
        x = randn(tokens, 48 + rope, dtype=dtype, seed=4)[:, None, 48:]
    assert not x.is_contiguous()
    cos, sin = _rope_tables(64, rope // 2, seed=5)
    positions = torch.randint(0, 64, (tokens,), generator=torch.Generator().manual_seed(6))
    out = AscendOps(npu).rotary(x, positions, cos, sin, interleaved=interleaved)
    expected = REF.rotary(x, positions, cos, sin, interleaved=interleaved)
    assert_matches(out, expected, dtype)
    assert not torch.allclose(out.float(), x.float(), atol=1e-2)  # really rotated
    [call] = npu.calls_of("npu_rotary_mul")
    assert call.args["rotary_mode"] == ("interleave" if interleaved else "half")


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(npu, dtype):
    x = randn(11, 2 * 24, dtype=dtype, seed=7)
    assert_matches(AscendOps(npu).silu_and_mul(x), REF.silu_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_on_a_view(npu, dtype):
    x = randn(11, 2 * 24 + 8, dtype=dtype, seed=8)[:, : 2 * 24]
    out = AscendOps(npu).silu_and_mul(x)  # npu_swiglu takes no views: the backend makes one contiguous
    assert_matches(out, REF.silu_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_and_head_linear(npu, dtype):
    x = randn(5, 3, 16, dtype=dtype, seed=9)
    weight = randn(3, 12, 16, dtype=dtype, seed=10, scale=0.3)
    assert_matches(AscendOps(npu).head_linear(x, weight), REF.head_linear(x, weight), dtype)
    flat = x[:, 0]  # a strided view
    w, b = randn(7, 16, dtype=dtype, seed=11), randn(7, dtype=dtype, seed=12)
    assert_matches(AscendOps(npu).linear(flat, w, b), REF.linear(flat, w, b), dtype)


ROUTES = {
    "greedy_softmax": (RoutingConfig(num_experts=16, top_k=4), False),
    "greedy_softmax_bias": (RoutingConfig(num_experts=16, top_k=4), True),
    "greedy_sigmoid_normalized": (
        RoutingConfig(num_experts=12, top_k=3, scoring="sigmoid", normalize=True, routed_scaling_factor=1.5),
        False,
    ),
    "group_limited_greedy": (
        RoutingConfig(num_experts=16, top_k=3, method="group_limited_greedy", num_groups=4, topk_groups=2),
        False,
    ),
    "noaux_tc_bias": (
        RoutingConfig(
            num_experts=32,
            top_k=6,
            method="noaux_tc",
            scoring="sigmoid",
            num_groups=8,
            topk_groups=3,
            normalize=True,
            routed_scaling_factor=2.5,
        ),
        True,
    ),  # fmt: skip
    "noaux_tc_groups_of_two": (
        RoutingConfig(num_experts=8, top_k=2, method="noaux_tc", scoring="sigmoid", num_groups=4, topk_groups=2),
        True,
    ),
}


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's (ids, weights) sorted by expert id: the contract leaves the order of the k experts free."""
    order = ids.argsort(dim=1)
    return ids.gather(1, order), weights.gather(1, order)


@pytest.mark.parametrize("logit_dtype", DTYPES)
@pytest.mark.parametrize("name", ROUTES)
def test_moe_route(npu, name, logit_dtype):
    config, with_bias = ROUTES[name]
    logits = randn(40, config.num_experts, dtype=logit_dtype, seed=13, scale=2.0)
    bias = randn(config.num_experts, seed=14, scale=0.3 if config.scoring == "sigmoid" else 0.05) if with_bias else None
    weights, ids = AscendOps(npu).moe_route(logits, config, bias)
    ref_weights, ref_ids = REF.moe_route(logits, config, bias)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (40, config.top_k)
    got_ids, got_weights = _by_expert(weights, ids)
    want_ids, want_weights = _by_expert(ref_weights, ref_ids)
    assert torch.equal(got_ids, want_ids), "chosen expert sets differ"
    torch.testing.assert_close(got_weights, want_weights, rtol=1e-6, atol=1e-7)
    if bias is not None:  # the bias really moved choices, so passing it wrong would show
        assert not torch.equal(want_ids, _by_expert(*REF.moe_route(logits, config, None))[0])


EXPERT_COUNTS = [0, 3, 5, 0, 4, 0, 1]  # zero-count experts first, inside and last


@pytest.mark.parametrize("dtype", DTYPES)
def test_expert_ffn_with_idle_experts(npu, dtype):
    experts, hidden, inter = len(EXPERT_COUNTS), 32, 16
    rows = sum(EXPERT_COUNTS)
    x = randn(rows, hidden + 8, dtype=dtype, seed=15)[:, :hidden]  # a strided view (not a transpose)
    w13 = randn(experts, 2 * inter, hidden, dtype=dtype, seed=16, scale=0.2)
    w2 = randn(experts, hidden, inter, dtype=dtype, seed=17, scale=0.2)
    counts = torch.tensor(EXPERT_COUNTS)
    out = AscendOps(npu).expert_ffn(x, counts, w13, w2)
    assert_matches(out, REF.expert_ffn(x, counts, w13, w2), dtype)
    gate_up, down = npu.calls_of("npu_grouped_matmul")
    running_sum = torch.tensor(EXPERT_COUNTS).cumsum(0).tolist()  # group_list_type 0: cumulative row ends
    assert gate_up.args["group_list"].tolist() == running_sum and gate_up.args["group_list_type"] == 0


def test_expert_ffn_without_rows(npu):
    x = torch.empty(0, 32)
    out = AscendOps(npu).expert_ffn(x, torch.zeros(3, dtype=torch.int64), torch.randn(3, 16, 32), torch.randn(3, 32, 8))
    assert out.shape == (0, 32) and not npu.calls


def test_expert_ffn_with_one_local_expert(npu):
    x, counts = randn(6, 32, seed=18), torch.tensor([6])
    w13, w2 = randn(1, 32, 32, seed=19, scale=0.2), randn(1, 32, 16, seed=20, scale=0.2)
    out = AscendOps(npu).expert_ffn(x, counts, w13, w2)  # a length-1 group_list needs group_list_type 0
    assert_matches(out, REF.expert_ffn(x, counts, w13, w2), torch.float32)
