"""DeepSeek-V4's op features in the nvidia_sm100 kernels against ReferenceOps, under Triton's interpreter: the
swiglu limit in `silu_and_mul` and in the grouped expert GEMM's fused activation (dense and FP8 weights),
and the capabilities that offer V4. (sqrtsoftplus and hash routing: test_routing_kernel.py; hyper-connections
and pooling: test_hyper_kernels.py; the whole model: test_v4_model.py.)"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.backend import V4_OPS, V41_OPS
from deepinfer_core.kv.layout import CacheKind
from deepinfer_nvidia_sm100 import plugin
from deepinfer_nvidia_sm100.kernels import elementwise
from deepinfer_nvidia_sm100.ops import NvidiaOps
from tests.backends.nvidia.test_dense_kernels import (
    COUNTS,
    OPS,
    REF,
    _truncate_to_bfloat16,
    assert_matches,
    expert_inputs,
    randn,
)
from tests.backends.nvidia.test_fp8_kernels import fp8

DTYPES = [torch.float32, torch.bfloat16]
# 2.995 lies nearer bfloat16's 3.0 than 2.984375: rounding it to nearest (the reference's clamp in bfloat16)
# and truncating it (the interpreter's float32 -> bfloat16 cast) differ, so a limit rounded in the kernel shows
LIMIT = 2.995


def with_outliers(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] with gates and ups far beyond the limit on both sides in every row, and one NaN gate."""
    inner = x.shape[1] // 2
    x[:, 0], x[:, 1], x[:, inner], x[:, inner + 1] = 9.0, -9.0, 9.0, -9.0
    x[0, 2] = float("nan")
    return x


# ----------------------------------------------------------------------------- silu_and_mul(limit=)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_with_limit(dtype):
    x = with_outliers(randn(6, 2 * 40, dtype=dtype, seed=1, scale=3.0))  # |x| > limit in a third of the lanes
    expected = REF.silu_and_mul(x, limit=LIMIT)
    assert not torch.equal(expected, REF.silu_and_mul(x)), "the clamp must act on these inputs"
    out = OPS.silu_and_mul(x, limit=LIMIT)
    assert torch.equal(out.isnan(), expected.isnan()), "NaN gates must stay NaN, as torch.clamp keeps them"
    assert_matches(out.nan_to_num(), expected.nan_to_num(), roundings=1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_with_limit_on_row_slice(dtype):
    wide = randn(4, 2 * 24 + 8, dtype=dtype, seed=2, scale=4.0)
    x = wide[:, : 2 * 24]  # a view with a wider row stride
    assert_matches(OPS.silu_and_mul(x, limit=LIMIT), REF.silu_and_mul(x, limit=LIMIT), roundings=1)


def test_silu_and_mul_bfloat16_clamps_at_the_rounded_limit():
    """Clamped lanes hold exactly silu(bf16(limit)) * bf16(limit): the limit is rounded to nearest, as the
    reference's clamp in bfloat16 rounds it, not truncated."""
    x = torch.full((1, 4), 9.0, dtype=torch.bfloat16)  # gate and up beyond the limit
    out = OPS.silu_and_mul(x, limit=LIMIT)
    assert elementwise.limit_in(LIMIT, torch.bfloat16) == (3.0, True)  # rounded on the host, to nearest
    limit = torch.tensor(3.0)
    expected = _truncate_to_bfloat16(_truncate_to_bfloat16(limit * torch.sigmoid(limit)) * limit)
    assert torch.equal(out.float(), expected.expand(1, 2))
    assert_matches(out, REF.silu_and_mul(x, limit=LIMIT), roundings=1)  # the reference rounds to nearest


def test_no_limit_is_todays_kernel():
    """limit=None compiles the unclamped specialisation: the same bits as before the limit existed."""
    x = randn(5, 2 * 40, dtype=torch.bfloat16, seed=3, scale=5.0)
    assert elementwise.limit_in(None, torch.bfloat16) == (0.0, False)
    assert torch.equal(OPS.silu_and_mul(x), elementwise.silu_and_mul(x))
    assert not torch.equal(OPS.silu_and_mul(x, limit=1.0), OPS.silu_and_mul(x))


# ----------------------------------------------------------------------------- expert_ffn(swiglu_limit=)


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "invariant"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_expert_ffn_with_swiglu_limit(dtype, batch_invariant):
    x, counts, w13, w2 = expert_inputs(COUNTS, dtype, seed=60)
    w13 = w13 * 4  # gate / up of std ~4: the limit clamps about half of them
    expected = REF.expert_ffn(x, counts, w13, w2, swiglu_limit=LIMIT)
    assert not torch.equal(expected, REF.expert_ffn(x, counts, w13, w2)), "the clamp must act on these inputs"
    out = NvidiaOps(batch_invariant).expert_ffn(x, counts, w13, w2, swiglu_limit=LIMIT)
    assert_matches(out, expected, reduced=40, roundings=3)


def test_expert_ffn_bfloat16_clamps_after_rounding_the_gemm():
    """The contract's formula with the interpreter's bfloat16 casts: the gate/up GEMM output rounded, then
    clamped at the limit rounded to nearest, then silu and the product rounded. Nearly every bit agrees."""
    x, counts, w13, w2 = expert_inputs(COUNTS, torch.bfloat16, seed=61)
    w13 = w13 * 4
    out = OPS.expert_ffn(x, counts, w13, w2, swiglu_limit=LIMIT)
    r, inner, limit = _truncate_to_bfloat16, w2.shape[2], 3.0  # LIMIT rounded to nearest in bfloat16
    expected, start = torch.empty(out.shape), 0
    for expert, count in enumerate(COUNTS):
        h = x[start : start + count].float() @ w13[expert].float().T  # [n, 2I]
        gate, up = r(h[:, :inner]).clamp(max=limit), r(h[:, inner:]).clamp(-limit, limit)
        act = r(r(gate / (1 + torch.exp(-gate))) * up)
        expected[start : start + count] = r(act @ w2[expert].float().T)
        start += count
    differs = out.float() != expected
    assert differs.float().mean() < 0.02  # float32 summation order may flip a rare last bit
    torch.testing.assert_close(out.float(), expected, rtol=torch.finfo(torch.bfloat16).eps, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_expert_ffn_with_fp8_weights_and_swiglu_limit(dtype):
    counts = torch.tensor([3, 0, 21, 1])
    x = randn(int(counts.sum()), 256, dtype=dtype, seed=62, scale=4.0)  # gate / up of std ~3.2
    w13, w2 = fp8(4, 256, 256, seed=63), fp8(4, 256, 128, seed=64)
    expected = REF.expert_ffn(x, counts, w13, w2, swiglu_limit=1.5)
    assert not torch.equal(expected, REF.expert_ffn(x, counts, w13, w2)), "the clamp must act on these inputs"
    got = NvidiaOps().expert_ffn(x, counts, w13, w2, swiglu_limit=1.5)
    assert_matches(got, expected, reduced=256, roundings=4)


def test_expert_ffn_rows_with_limit_bitwise_equal_for_any_batch_size():
    x, counts, w13, w2 = expert_inputs([5, 0, 12], torch.bfloat16, seed=65)
    w13 = w13 * 4
    together = OPS.expert_ffn(x, counts, w13, w2, swiglu_limit=LIMIT)
    alone = [OPS.expert_ffn(x[i : i + 1], torch.tensor([0, 0, 1]), w13, w2, swiglu_limit=LIMIT) for i in (5, 9, 16)]
    assert torch.equal(torch.cat(alone), together[[5, 9, 16]])


# ----------------------------------------------------------------------------- capabilities


def test_capabilities_offer_deepseek_v4():
    caps = plugin.deepinfer_backend_capabilities()
    assert all(caps.supports(op) is True for op in V4_OPS)
    assert set(caps.cache_kinds) == set(CacheKind)
    assert caps.batch_invariant and caps.supports("v4_batch_invariance") is True  # V4 models too (conformance)
    assert caps.unsupported == ()
    assert all(caps.supports(op) is True for op in V41_OPS)
