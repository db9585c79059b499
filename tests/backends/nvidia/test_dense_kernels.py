"""Each NvidiaOps op against ReferenceOps on fresh random inputs, float32 and bfloat16, under Triton's interpreter."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer_core.reference.ops import ReferenceOps
from deepinfer_nvidia_sm100.kernels import gemm
from deepinfer_nvidia_sm100.ops import NvidiaOps

DTYPES = [torch.float32, torch.bfloat16]
REF = ReferenceOps()
OPS = NvidiaOps(batch_invariant=True)  # linear / head_linear go through the Triton GEMM


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, *, reduced: int = 1, roundings: int = 0):
    """torch.testing's defaults scaled for a reduction over `reduced` terms.

    roundings: intermediates the reference rounds to bfloat16; the kernel rounds them too but may land one
    ulp away, so allow one bfloat16 ulp of the output's magnitude for each. (The interpreter truncates
    every float32 -> bfloat16 cast instead of rounding to nearest, so these errors add up, not cancel.)
    """
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    atol = 1e-5 * math.sqrt(reduced)
    if actual.dtype == torch.float32:
        rtol = 1.3e-6
    else:
        rtol = 1.6e-2
        atol += roundings * torch.finfo(torch.bfloat16).eps * expected.float().abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


# ----------------------------------------------------------------------------- row-local kernels


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_contiguous_and_3d(dtype):
    x, w = randn(3, 4, 48, dtype=dtype, seed=1), randn(48, dtype=dtype, seed=2)
    assert_matches(OPS.rms_norm(x, w, 1e-6), REF.rms_norm(x, w, 1e-6), reduced=48)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_on_column_slice_of_wider_tensor(dtype):
    kv = randn(7, 40 + 16, dtype=dtype, seed=3)  # [T, C + R]: MLA's compressed kv beside its rope part
    w = randn(40, dtype=dtype, seed=4)
    out = OPS.rms_norm(kv[:, :40], w, 1e-6)
    assert_matches(out, REF.rms_norm(kv[:, :40], w, 1e-6), reduced=40)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_on_transposed_view(dtype):
    x = randn(33, 5, dtype=dtype, seed=5).t()  # [5, 33], last stride 5
    w = randn(33, dtype=dtype, seed=6)
    assert_matches(OPS.rms_norm(x, w, 1e-5), REF.rms_norm(x, w, 1e-5), reduced=33)


def _rope_tables(max_pos: int, half: int, dtype: torch.dtype):
    angles = torch.arange(max_pos)[:, None] * (10000.0 ** (-torch.arange(half) / half))[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "rotate_half"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_on_rope_part_of_query_heads(dtype, interleaved):
    nope, rope = 24, 16
    q = randn(6, 3, nope + rope, dtype=dtype, seed=7)  # [T, H, nope + R]
    positions = torch.tensor([0, 5, 2, 63, 17, 17])
    cos, sin = _rope_tables(64, rope // 2, dtype)
    view = q[..., nope:]
    out = OPS.rotary(view, positions, cos, sin, interleaved=interleaved)
    assert_matches(out, REF.rotary(view, positions, cos, sin, interleaved=interleaved))


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "rotate_half"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_on_shared_key_rope_of_latent(dtype, interleaved):
    latent, rope = 40, 12  # R/2 = 6: not a power of two, the masked pair lanes are exercised
    kv = randn(5, latent + rope, dtype=dtype, seed=8)
    positions = torch.tensor([3, 0, 9, 1, 30])
    cos, sin = _rope_tables(32, rope // 2, dtype)
    view = kv[:, None, latent:]  # [T, 1, R]
    out = OPS.rotary(view, positions, cos, sin, interleaved=interleaved)
    assert_matches(out, REF.rotary(view, positions, cos, sin, interleaved=interleaved))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = randn(5, 2 * 40, dtype=dtype, seed=9, scale=3.0)
    assert_matches(OPS.silu_and_mul(x), REF.silu_and_mul(x), roundings=1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_on_row_slice_of_wider_tensor(dtype):
    wide = randn(4, 2 * 24 + 8, dtype=dtype, seed=10, scale=3.0)
    x = wide[:, : 2 * 24]
    assert_matches(OPS.silu_and_mul(x), REF.silu_and_mul(x), roundings=1)


# ----------------------------------------------------------------------------- GEMMs

# (N, K): one K pass, and a K long enough that the GEMM splits it (checked in the test)
GEMM_SHAPES = {"one_split": (40, 48), "split_k": (32, 256)}


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("shape", GEMM_SHAPES.values(), ids=GEMM_SHAPES.keys())
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear(dtype, shape, with_bias):
    n, k = shape
    assert (gemm.split_count(n, k, dtype) > 1) == (k == 256)
    x, w = randn(2, 9, k, dtype=dtype, seed=11), randn(n, k, dtype=dtype, seed=12)
    bias = randn(n, dtype=dtype, seed=13) if with_bias else None
    assert_matches(OPS.linear(x, w, bias), REF.linear(x, w, bias), reduced=k)


# (N, K, dtype, K splits) at the GPU's bfloat16 tiles (64 x 64 x 64) / float32 tiles (32 x 32 x 32), 132 programs
# a wave: column tiles filling under half a wave fill one wave; half a wave or more, about two; one full wave, one
SPLIT_RULE = [
    (512, 5120, torch.bfloat16, 8),  # 8 column tiles: 16 splits would fill the wave; at most 8
    (1280, 5120, torch.bfloat16, 6),  # 20 tiles: 6 splits, 120 programs
    (5120, 8192, torch.bfloat16, 4),  # 80 tiles (V4.1's o_b): 4 splits, 320 programs, not 1 split's 80
    (4608, 5120, torch.bfloat16, 4),  # 72 tiles (the shared expert's gate_up)
    (32768, 1280, torch.bfloat16, 1),  # 512 tiles: several waves already
    (5120, 256, torch.bfloat16, 1),  # 4 K tiles: too short to split
    (24, 20480, torch.float32, 128),  # a hyper-connection mixer: one column tile, 640 K tiles
    (32, 5120, torch.float32, 80),  # a router: 160 K tiles, at least 2 a split
]


@pytest.mark.parametrize("n, k, dtype, splits", SPLIT_RULE)
def test_split_count_rule(n, k, dtype, splits):
    tiles = (32, 32, 32, 4) if dtype == torch.float32 else (64, 64, 64, 4)
    assert gemm.split_count(n, k, dtype, tiles) == splits


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_on_strided_input_and_transposed_weight(dtype):
    x = randn(6, 80, dtype=dtype, seed=14)[:, 8:72]  # [6, 64], row stride 80
    w = randn(64, 24, dtype=dtype, seed=15).t()  # [24, 64] stored K-major
    assert_matches(OPS.linear(x, w), REF.linear(x, w), reduced=64)


def test_linear_default_mode_uses_torch_and_matches():
    x, w = randn(3, 32, dtype=torch.float32, seed=16), randn(8, 32, dtype=torch.float32, seed=17)
    assert_matches(NvidiaOps(batch_invariant=False).linear(x, w), REF.linear(x, w), reduced=32)


HEAD_SHAPES = {"one_split": (16, 48), "split_k": (16, 256)}  # (N, K) per head


@pytest.mark.parametrize("shape", HEAD_SHAPES.values(), ids=HEAD_SHAPES.keys())
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_linear_on_nope_part_of_query(dtype, shape):
    n, k = shape
    assert (gemm.split_count(n, k, dtype) > 1) == (k == 256)
    q = randn(5, 3, k + 16, dtype=dtype, seed=18)
    x = q[..., :k]  # [T, H, K], a view: MLA absorbs W_UK into the nope part of q
    w = randn(3, n, k, dtype=dtype, seed=19)
    assert_matches(OPS.head_linear(x, w), REF.head_linear(x, w), reduced=k)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_head_linear_both_modes_match(batch_invariant):
    x, w = randn(4, 2, 32, dtype=torch.float32, seed=20), randn(2, 8, 32, dtype=torch.float32, seed=21)
    assert_matches(NvidiaOps(batch_invariant).head_linear(x, w), REF.head_linear(x, w), reduced=32)


def test_zero_rows_give_empty_outputs():
    w = randn(8, 32, dtype=torch.float32, seed=22)
    assert OPS.linear(torch.empty(0, 32), w).shape == (0, 8)
    assert OPS.rms_norm(torch.empty(0, 32), w[0], 1e-6).shape == (0, 32)
    assert OPS.silu_and_mul(torch.empty(0, 32)).shape == (0, 16)
    cos, sin = _rope_tables(4, 4, torch.float32)
    rotated = OPS.rotary(torch.empty(0, 2, 8), torch.empty(0, dtype=torch.long), cos, sin, interleaved=True)
    assert rotated.shape == (0, 2, 8)


# ----------------------------------------------------------------------------- grouped expert GEMM

# rows per expert: zeros (leading, inner, trailing), one single row, one expert with more rows than a tile (16)
COUNTS = [0, 1, 21, 0, 5, 0]


def expert_inputs(counts: list[int], dtype: torch.dtype, hidden: int = 40, inner: int = 24, seed: int = 0):
    """x [N, D], tokens_per_expert [E], w13 [E, 2I, D], w2 [E, D, I]; D and I are not tile multiples."""
    experts = len(counts)
    x = randn(sum(counts), hidden, dtype=dtype, seed=seed)
    w13 = randn(experts, 2 * inner, hidden, dtype=dtype, seed=seed + 1, scale=hidden**-0.5)
    w2 = randn(experts, hidden, inner, dtype=dtype, seed=seed + 2, scale=inner**-0.5)
    return x, torch.tensor(counts), w13, w2


@pytest.mark.parametrize("dtype", DTYPES)
def test_expert_ffn_with_empty_single_and_multi_tile_experts(dtype):
    x, counts, w13, w2 = expert_inputs(COUNTS, dtype)
    out = OPS.expert_ffn(x, counts, w13, w2)
    assert_matches(out, REF.expert_ffn(x, counts, w13, w2), reduced=40, roundings=3)  # gate/up, silu, product


def test_expert_ffn_every_expert_used():
    x, counts, w13, w2 = expert_inputs([3, 17, 2], torch.float32, hidden=64, inner=48, seed=30)
    assert_matches(OPS.expert_ffn(x, counts, w13, w2), REF.expert_ffn(x, counts, w13, w2), reduced=64)


def _truncate_to_bfloat16(t: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16 as Triton's interpreter casts (drop the low 16 bits), back in float32."""
    return (t.float().contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32)


def test_expert_ffn_bfloat16_rounds_where_the_reference_does():
    """The contract's formula with its bfloat16 roundings made by the interpreter's cast: nearly every bit agrees.

    A kernel that skipped rounding the gate/up output or the activation differs in most elements.
    """
    x, counts, w13, w2 = expert_inputs(COUNTS, torch.bfloat16, seed=40)
    out = OPS.expert_ffn(x, counts, w13, w2)
    r, inner = _truncate_to_bfloat16, w2.shape[2]
    expected, start = torch.empty(out.shape), 0
    for expert, count in enumerate(COUNTS):
        h = x[start : start + count].float() @ w13[expert].float().T  # [n, 2I]
        gate, up = r(h[:, :inner]), r(h[:, inner:])
        act = r(r(gate / (1 + torch.exp(-gate))) * up)
        expected[start : start + count] = r(act @ w2[expert].float().T)
        start += count
    differs = out.float() != expected
    assert differs.float().mean() < 0.02  # float32 summation order may flip a rare last bit
    torch.testing.assert_close(out.float(), expected, rtol=torch.finfo(torch.bfloat16).eps, atol=1e-5)


# V4.1's routing weights applied before w2 (row_scales): the activation is scaled in float32, then rounded once


def row_scales_for(rows: int, seed: int) -> torch.Tensor:
    """[rows] float32 routing-weight-like scales in [0.05, 2): far enough from 1 that a missed scale shows."""
    return 0.05 + 1.95 * torch.rand(rows, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("limit", [None, 1.5], ids=["no_limit", "swiglu_limit"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_expert_ffn_with_row_scales(dtype, limit):
    x, counts, w13, w2 = expert_inputs(COUNTS, dtype, seed=60)
    w13 = w13 * 3  # gate / up of std ~3: the limit clamps about a third of them
    scales = row_scales_for(x.shape[0], seed=61)
    out = OPS.expert_ffn(x, counts, w13, w2, swiglu_limit=limit, row_scales=scales)
    expected = REF.expert_ffn(x, counts, w13, w2, swiglu_limit=limit, row_scales=scales)
    assert not torch.equal(expected, REF.expert_ffn(x, counts, w13, w2, swiglu_limit=limit)), "scales must act"
    assert_matches(out, expected, reduced=40, roundings=3)  # gate/up, the scaled activation, product


def test_expert_ffn_row_scales_bfloat16_round_once():
    """With row_scales, silu(gate) * up * scale is float32 and rounded once, as the interpreter's cast rounds
    it: nearly every bit agrees. A kernel that still rounded silu(gate), or rounded before scaling, would not."""
    x, counts, w13, w2 = expert_inputs(COUNTS, torch.bfloat16, seed=62)
    scales = row_scales_for(x.shape[0], seed=63)
    out = OPS.expert_ffn(x, counts, w13, w2, row_scales=scales)
    r, inner = _truncate_to_bfloat16, w2.shape[2]
    expected, start = torch.empty(out.shape), 0
    for expert, count in enumerate(COUNTS):
        h = x[start : start + count].float() @ w13[expert].float().T  # [n, 2I]
        gate, up = r(h[:, :inner]), r(h[:, inner:])
        act = r(gate / (1 + torch.exp(-gate)) * up * scales[start : start + count, None])
        expected[start : start + count] = r(act @ w2[expert].float().T)
        start += count
    differs = out.float() != expected
    assert differs.float().mean() < 0.02  # float32 summation order may flip a rare last bit
    torch.testing.assert_close(out.float(), expected, rtol=torch.finfo(torch.bfloat16).eps, atol=1e-5)


def test_expert_ffn_refuses_row_scales_of_another_length():
    x, counts, w13, w2 = expert_inputs([2, 3], torch.float32, seed=64)
    with pytest.raises(ValueError, match="one scale per row"):
        OPS.expert_ffn(x, counts, w13, w2, row_scales=torch.ones(4))


# ----------------------------------------------------------------------------- strided 1-D inputs
# The contract lets every input be a view, 1-D parameters (weights, bias, counts) included.


def test_rms_norm_with_strided_weight():
    x, w = randn(4, 32, dtype=torch.float32, seed=50), randn(64, dtype=torch.float32, seed=51)[::2]
    assert_matches(OPS.rms_norm(x, w, 1e-6), REF.rms_norm(x, w, 1e-6), reduced=32)


@pytest.mark.parametrize("k", [32, 256], ids=["one_split", "split_k"])
def test_linear_with_strided_bias(k):
    x, w = randn(4, k, dtype=torch.float32, seed=52), randn(8, k, dtype=torch.float32, seed=53)
    bias = randn(16, dtype=torch.float32, seed=54)[::2]
    assert_matches(OPS.linear(x, w, bias), REF.linear(x, w, bias), reduced=k)


def test_expert_ffn_with_strided_token_counts():
    x, counts, w13, w2 = expert_inputs([2, 0, 18], torch.float32, seed=55)
    strided = torch.stack([counts, torch.zeros_like(counts)], dim=1)[:, 0]  # same values, stride 2
    assert_matches(OPS.expert_ffn(x, strided, w13, w2), REF.expert_ffn(x, counts, w13, w2), reduced=40)
