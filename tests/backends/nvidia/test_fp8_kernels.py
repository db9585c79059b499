"""FP8 weights (ops.BlockFP8) in the Triton GEMMs, under Triton's interpreter: the result is the GEMM of the
dequantized weight, in both modes, and the batch-invariant GEMM stays bitwise invariant with them."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.backend.ops import BlockFP8
from deepinfer_nvidia_sm100.kernels import gemm
from deepinfer_nvidia_sm100.ops import NvidiaOps
from tests.backends.nvidia.test_dense_kernels import REF, assert_matches, randn

DTYPES = [torch.float32, torch.bfloat16]


def fp8(*shape: int, seed: int, block=(128, 128)) -> BlockFP8:
    return BlockFP8.quantize(randn(*shape, dtype=torch.float32, seed=seed, scale=0.2), block)


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "invariant"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,k", [(200, 300), (64, 512)], ids=["cropped_blocks", "split_k"])
def test_linear_with_fp8_weight_is_the_dequantized_gemm(dtype, n, k, batch_invariant):
    weight, bias = fp8(n, k, seed=1), randn(n, dtype=dtype, seed=2)
    x = randn(7, k, dtype=dtype, seed=3)
    ops = NvidiaOps(batch_invariant=batch_invariant)
    # roundings: the reference rounds the dequantized weight to bfloat16 first; the kernel never does
    assert_matches(ops.linear(x, weight, bias), REF.linear(x, weight, bias), reduced=k, roundings=2)


def test_split_k_path_is_taken_for_the_split_shape():
    assert gemm.split_count(64, 512, torch.float32) > 1


@pytest.mark.usefixtures("fixed_order_dot")  # a row's bits by the kernel's K order, not by its place (conftest)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_rows_are_bitwise_batch_invariant(dtype):
    weight = fp8(64, 512, seed=4)
    x = randn(40, 512, dtype=dtype, seed=5)
    alone = torch.cat([gemm.matmul(x[i : i + 1], weight) for i in range(0, 40, 13)])
    together = gemm.matmul(x, weight)[0:40:13]
    assert torch.equal(alone, together)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("quantized", ["both", "down_only"])
def test_expert_ffn_with_fp8_weights_is_the_dequantized_ffn(dtype, quantized):
    counts = torch.tensor([3, 0, 21, 1])
    x = randn(int(counts.sum()), 256, dtype=dtype, seed=6)
    w13 = fp8(4, 256, 256, seed=7)  # 2I = 256: gate and up are whole 128-row blocks
    w2 = fp8(4, 256, 128, seed=8)
    if quantized == "down_only":  # the model keeps gate|up dense when I is not whole blocks
        w13 = w13.dequantize(dtype)
    got = NvidiaOps().expert_ffn(x, counts, w13, w2)
    assert_matches(got, REF.expert_ffn(x, counts, w13, w2), reduced=256, roundings=4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_expert_ffn_with_fp8_weights_and_row_scales(dtype):
    counts = torch.tensor([3, 0, 21, 1])
    x = randn(int(counts.sum()), 256, dtype=dtype, seed=11)
    w13, w2 = fp8(4, 256, 256, seed=12), fp8(4, 256, 128, seed=13)
    scales = 0.05 + torch.rand(int(counts.sum()), generator=torch.Generator().manual_seed(14))
    got = NvidiaOps().expert_ffn(x, counts, w13, w2, row_scales=scales)
    assert_matches(got, REF.expert_ffn(x, counts, w13, w2, row_scales=scales), reduced=256, roundings=4)


def test_scale_blocks_narrower_than_a_tile_are_refused():
    weight = fp8(64, 64, seed=9, block=(16, 16))  # 16 columns per block: K tiles are 32 here
    with pytest.raises(ValueError, match="not whole"):
        gemm.matmul(randn(2, 64, dtype=torch.float32, seed=10), weight)
