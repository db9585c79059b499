"""A row's GEMM and expert-FFN result is bitwise the same whatever other rows share the call, and the check can fail.

Every test here runs with the interpreter's tl.dot summed in one fixed order (conftest.fixed_order_dot): numpy's
BLAS may round a row by its place in the tile, and these tests are about the kernel's tiling, not the CPU's BLAS.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer_nvidia_sm100.kernels import gemm, moe
from deepinfer_nvidia_sm100.ops import NvidiaOps

pytestmark = pytest.mark.usefixtures("fixed_order_dot")

DTYPES = [torch.float32, torch.bfloat16]
ROWS = 40
BATCH_SIZES = [1, 3, 17, 40]


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def in_batches_of(m: int, x: torch.Tensor, fn) -> torch.Tensor:
    """fn applied to consecutive slices of m rows of x, results concatenated: row i computed among m rows."""
    return torch.cat([fn(x[start : start + m]) for start in range(0, x.shape[0], m)])


# (N, K, expected K splits): a K long enough to be split in several float32 partial sums, and one pass
GEMM_SHAPES = {"split_k": (32, 256, "many"), "one_split": (40, 48, "one")}


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("shape", GEMM_SHAPES.values(), ids=GEMM_SHAPES.keys())
@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_rows_bitwise_equal_for_any_batch_size(dtype, shape, with_bias):
    """A row sits at another place of another tile for each batch size; with the dot's per-element order fixed,
    only the kernel's own K order (tile size, splits, split-sum order) can change its bits, and that is checked."""
    n, k, splits = shape
    assert (gemm.split_count(n, k, dtype) > 1) == (splits == "many")  # the split path really runs
    x, w = randn(ROWS, k, dtype=dtype, seed=1), randn(n, k, dtype=dtype, seed=2)
    bias = randn(n, dtype=dtype, seed=3) if with_bias else None
    results = [in_batches_of(m, x, lambda rows: gemm.matmul(rows, w, bias)) for m in BATCH_SIZES]
    for m, result in zip(BATCH_SIZES[1:], results[1:]):
        assert torch.equal(result, results[0]), f"rows computed {m} at a time differ from one at a time"


@pytest.mark.parametrize("tiles, waves", [((16, 32, 32, 4), 2), ((32, 32, 64, 4), 4)], ids=["bm16", "bm32_bk64"])
def test_the_benchmarks_other_tilings_are_batch_invariant_too(tiles, waves):
    """bench/gpu_gemm.py times other fixed tilings as candidates for production: each keeps a row's bits."""
    x, w = randn(ROWS, 512, dtype=torch.float32, seed=6), randn(32, 512, dtype=torch.float32, seed=7)
    assert gemm.split_count(32, 512, torch.float32, tiles, waves) > 1

    def tiled(rows: torch.Tensor) -> torch.Tensor:
        return gemm.batched_matmul(rows[None], w[None], tiles=tiles, waves=waves)[0]

    results = [in_batches_of(m, x, tiled) for m in BATCH_SIZES]
    for m, result in zip(BATCH_SIZES[1:], results[1:]):
        assert torch.equal(result, results[0]), f"rows computed {m} at a time differ from one at a time"
    torch.testing.assert_close(results[0], F.linear(x, w), rtol=1.3e-6, atol=1e-5 * 512**0.5)


def test_head_linear_tokens_bitwise_equal_for_any_batch_size():
    ops = NvidiaOps(batch_invariant=True)
    x, w = randn(17, 2, 256, dtype=torch.float32, seed=4), randn(2, 16, 256, dtype=torch.float32, seed=5)
    assert gemm.split_count(16, 256, torch.float32) > 1
    one_at_a_time = in_batches_of(1, x, lambda rows: ops.head_linear(rows, w))
    assert torch.equal(ops.head_linear(x, w), one_at_a_time)


# ----------------------------------------------------------------------------- grouped expert GEMM


def expert_weights(experts: int, dtype: torch.dtype, hidden: int = 40, inner: int = 24):
    w13 = randn(experts, 2 * inner, hidden, dtype=dtype, seed=6) * hidden**-0.5
    w2 = randn(experts, hidden, inner, dtype=dtype, seed=7) * inner**-0.5
    return w13, w2


@pytest.mark.parametrize("row_scaled", [False, True], ids=["unscaled", "row_scales"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_expert_rows_bitwise_equal_when_other_experts_rows_change(dtype, row_scaled):
    w13, w2 = expert_weights(5, dtype)
    mine = randn(21, 40, dtype=dtype, seed=8)  # expert 2's rows: more than one row tile
    others = randn(40, 40, dtype=dtype, seed=9)
    scale_pool = torch.rand(61, generator=torch.Generator().manual_seed(10)) + 0.1  # V4.1's routing weights
    my_scales, other_scales = scale_pool[:21], scale_pool[21:]

    def expert2_rows(before: list[int], after: list[int]) -> torch.Tensor:
        """Expert 2's output rows with `before` rows for experts 0, 1 and `after` rows for experts 3, 4."""
        lead, trail = sum(before), sum(after)
        x = torch.cat([others[:lead], mine, others[lead : lead + trail]])
        scales = torch.cat([other_scales[:lead], my_scales, other_scales[lead : lead + trail]]) if row_scaled else None
        counts = torch.tensor([*before, len(mine), *after])
        return moe.expert_ffn(x, counts, w13, w2, row_scales=scales)[lead : lead + len(mine)]

    alone = expert2_rows([0, 0], [0, 0])
    for before, after in [([3, 0], [5, 0]), ([17, 2], [9, 1]), ([0, 1], [0, 0]), ([0, 0], [20, 0])]:
        assert torch.equal(expert2_rows(before, after), alone), f"experts' rows {before}, {after} changed expert 2's"


# ----------------------------------------------------------------------------- negative controls


def test_fixed_order_dot_computes_the_product():
    """The dot the bitwise tests run with is a float32 GEMM, not something whose bits agree trivially."""
    x, w = randn(5, 256, dtype=torch.float32, seed=14), randn(32, 256, dtype=torch.float32, seed=15)
    torch.testing.assert_close(gemm.matmul(x, w), F.linear(x, w), rtol=1.3e-6, atol=1e-5 * 256**0.5)


def test_bitwise_check_detects_a_different_k_summation_order():
    """Splitting K in two partial sums changes some bits: torch.equal is not vacuous for GEMM results."""
    x, w = randn(8, 256, dtype=torch.float32, seed=10), randn(32, 256, dtype=torch.float32, seed=11)
    split = F.linear(x[:, :37], w[:, :37]) + F.linear(x[:, 37:], w[:, 37:])  # not at a BLAS block edge
    torch.testing.assert_close(split, F.linear(x, w))  # the same numbers...
    assert not torch.equal(split, F.linear(x, w))  # ...but not the same bits


def test_bitwise_check_catches_a_gemm_whose_split_depends_on_the_batch(monkeypatch):
    """Were the K split chosen per call (as by M), the matmul invariance test would fail."""
    x, w = randn(3, 256, dtype=torch.float32, seed=12), randn(32, 256, dtype=torch.float32, seed=13)
    assert gemm.split_count(32, 256, torch.float32) > 1
    fixed = gemm.matmul(x, w)
    monkeypatch.setattr(gemm, "split_count", lambda n, k, dtype, *tiling: 1)
    unsplit = gemm.matmul(x, w)
    torch.testing.assert_close(unsplit, fixed)
    assert not torch.equal(unsplit, fixed)
