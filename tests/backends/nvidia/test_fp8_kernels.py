"""Quantized weights in the Triton GEMMs, under Triton's interpreter: FP8 (ops.BlockFP8, float32 or E8M0 scales,
blocks spanning or dividing the K tile) and FP4 experts (ops.MXFP4). The result is the GEMM of the dequantized
weight, in both modes, and the batch-invariant GEMM stays bitwise invariant with them."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.backend.ops import MXFP4, BlockFP8
from deepinfer_nvidia_sm100.kernels import gemm
from deepinfer_nvidia_sm100.ops import NvidiaOps
from tests.backends.nvidia.test_dense_kernels import REF, assert_matches, randn

DTYPES = [torch.float32, torch.bfloat16]


def fp8(*shape: int, seed: int, block=(128, 128), scales="float32") -> BlockFP8:
    return BlockFP8.quantize(randn(*shape, dtype=torch.float32, seed=seed, scale=0.2), block, scales)


def fp4(*shape: int, seed: int) -> MXFP4:
    return MXFP4.quantize(randn(*shape, dtype=torch.float32, seed=seed, scale=0.2))


# the default mode's tiling follows the rows (kernels/fp8_tilings: one per measured row count); the batch-invariant
# mode's does not (two row counts: one row tile and several)
MODES_ROWS = [(False, rows) for rows in (7, 20, 50, 100, 200)] + [(True, 7), (True, 130)]


@pytest.mark.parametrize(
    "batch_invariant,rows", MODES_ROWS, ids=[f"{'invariant' if b else 'default'}-{r}" for b, r in MODES_ROWS]
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,k", [(200, 300), (64, 512)], ids=["cropped_blocks", "split_k"])
def test_linear_with_fp8_weight_is_the_dequantized_gemm(dtype, n, k, batch_invariant, rows):
    weight, bias = fp8(n, k, seed=1), randn(n, dtype=dtype, seed=2)
    x = randn(rows, k, dtype=dtype, seed=3)
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


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "invariant"])
@pytest.mark.parametrize("block", [(128, 128), (32, 32), (16, 16)], ids=["128", "32", "16_inside_a_tile"])
def test_linear_with_e8m0_scaled_fp8_is_the_dequantized_gemm(block, batch_invariant):
    """V4 / V4.1's FP8: power-of-two scales as E8M0 bytes; 16-column blocks divide the interpreter's 32-column K
    tiles (as V4.1's 32 divide the GPU's 64), so one tile multiplies two scales a column."""
    dtype = torch.bfloat16
    weight, x = fp8(72, 160, seed=15, block=block, scales="e8m0"), randn(5, 160, dtype=dtype, seed=16)
    assert weight.pow2_scales
    ops = NvidiaOps(batch_invariant=batch_invariant)
    assert_matches(ops.linear(x, weight), REF.linear(x, weight), reduced=160, roundings=2)


def test_e8m0_scale_bytes_at_both_ends_dequantize_as_the_reference():
    """Scale byte 0 (2^-127, a float32 subnormal) and 254 (2^127) through the kernel's E8M0 decoding."""
    values = torch.full((2, 32), 0.5).to(torch.float8_e4m3fn)
    scales = torch.tensor([[0], [200]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    weight = BlockFP8(values, scales, (1, 32))
    x = torch.ones(1, 32)
    got = gemm.matmul(x, weight)
    assert torch.equal(got, REF.linear(x, weight)) and got[0, 0].item() == 16 * 2.0**-127


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fixed_tiles", [True, False], ids=["invariant", "default"])
def test_expert_ffn_with_fp4_experts_is_the_dequantized_ffn(dtype, fixed_tiles):
    """V4 / V4.1's routed experts: e2m1 pairs unpacked (low nibble first) and scaled per 32 in registers."""
    counts = torch.tensor([3, 0, 21, 1])
    x = randn(int(counts.sum()), 128, dtype=dtype, seed=17)
    w13, w2 = fp4(4, 192, 128, seed=18), fp4(4, 128, 96, seed=19)  # I = 96: three 32-blocks along w2's K
    got = NvidiaOps().expert_ffn(x, counts, w13, w2)
    assert_matches(got, REF.expert_ffn(x, counts, w13, w2), reduced=128, roundings=4)
    scales = 0.05 + torch.rand(int(counts.sum()), generator=torch.Generator().manual_seed(20))
    got = NvidiaOps().expert_ffn(x, counts, w13, w2, row_scales=scales, swiglu_limit=1.0)
    want = REF.expert_ffn(x, counts, w13, w2, row_scales=scales, swiglu_limit=1.0)
    assert_matches(got, want, reduced=128, roundings=4)


def test_fp4_tiles_unpack_every_code_in_its_place():
    """One expert whose weight is a hand-made code pattern, x one-hot: each output is one weight element, so a
    swapped nibble or a scale on the wrong 32 shows as a wrong value, exactly."""
    codes = torch.arange(64, dtype=torch.uint8).remainder(16)  # [64] codes along K
    packed = (codes[0::2] | codes[1::2] << 4).repeat(2, 1)  # 2 rows of K = 64
    scales = torch.tensor([[127, 129], [126, 127]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    weight = MXFP4(packed[None], scales[None])  # [1, 2, 64]
    eye = torch.eye(64)
    got = gemm.matmul(eye, MXFP4(weight.weight[0], weight.scale[0]))  # [64, 2]: column n = row n of W
    assert torch.equal(got.T, weight.dequantize()[0])


def test_scale_blocks_that_neither_span_nor_divide_a_tile_are_refused():
    weight = fp8(64, 96, seed=9, block=(24, 24))  # 24 columns per block: K tiles are 32 here
    with pytest.raises(ValueError, match="neither span nor divide"):
        gemm.matmul(randn(2, 96, dtype=torch.float32, seed=10), weight)
