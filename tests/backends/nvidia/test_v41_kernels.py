"""DeepSeek-V4.1's ops on the nvidia backend (kernels.hyper's V4.1 variants, kernels.rounding, kernels.engram)
against ReferenceOps under Triton's interpreter: float32 and bfloat16 streams, 3 and 4 streams, widths the
column blocks do not divide; round_to_format bitwise on crafted blocks (ties, clamps, tiny scales, zeros,
NaN); and each op's rows bitwise the same alone and inside a batch of 21, V4's hc_pre among them."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.backend.ops import BLOCK_FORMATS
from deepinfer_nvidia_sm100.ops import NvidiaOps
from tests.backends.nvidia.test_dense_kernels import REF, assert_matches, randn

DTYPES = [torch.float32, torch.bfloat16]
WIDTHS = [48, 1100]  # masked lanes in one column block; several blocks and a ragged last one
KWARGS = dict(sinkhorn_iters=3, eps=1e-6, norm_eps=1e-6)


def streams_view(tokens: int, n: int, hidden: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return randn(tokens, n, hidden + 8, dtype=dtype, seed=seed)[:, :, :hidden]  # [T, N, D], a view


def mixer(n: int, hidden: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's (fn, scale, base) float32: mixes O(1), no sigmoid or softmax saturated."""
    rows = (2 + n) * n
    fn = randn(rows, n * hidden, dtype=torch.float32, seed=seed, scale=(n * hidden) ** -0.5)
    scale = 1.0 + 0.5 * randn(3, dtype=torch.float32, seed=seed + 1)
    return fn, scale, randn(rows, dtype=torch.float32, seed=seed + 2, scale=0.5)


# ----------------------------------------------------------------------------- hyper-connections


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "invariant"])
@pytest.mark.parametrize("hidden", WIDTHS)
@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_hc_mixes(tokens, dtype, n, hidden, batch_invariant):
    streams = streams_view(tokens, n, hidden, dtype, seed=1)
    pre, post, comb = NvidiaOps(batch_invariant).hc_mixes(streams, *mixer(n, hidden, seed=2), **KWARGS)
    ref_pre, ref_post, ref_comb = REF.hc_mixes(streams, *mixer(n, hidden, seed=2), **KWARGS)
    assert pre.dtype == post.dtype == comb.dtype == torch.float32
    for actual, expected in ((pre, ref_pre), (post, ref_post), (comb, ref_comb)):
        assert_matches(actual, expected, reduced=n * hidden)


def test_hc_mixes_refuses_the_head_form_as_the_reference_does():
    streams = streams_view(2, 4, 48, torch.float32, seed=3)
    head = (randn(4, 4 * 48, dtype=torch.float32, seed=4), torch.ones(1), torch.zeros(4))
    with pytest.raises(ValueError) as ours:
        NvidiaOps().hc_mixes(streams, *head, **KWARGS)
    with pytest.raises(ValueError) as theirs:
        REF.hc_mixes(streams, *head, **KWARGS)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("hidden", WIDTHS)
@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_hc_collapse(tokens, dtype, n, hidden):
    streams = streams_view(tokens, n, hidden, dtype, seed=5)
    pre = randn(tokens, n, dtype=torch.float32, seed=6).sigmoid() + 1e-6
    out = NvidiaOps().hc_collapse(streams, pre)
    assert_matches(out, REF.hc_collapse(streams, pre), reduced=n, roundings=1)


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_hc_collapse_is_bitwise_hc_pres_collapse(dtype, n):
    """The contract: hc_collapse by hc_mixes' pre is bitwise hc_pre's collapse (one helper, the same lanes)."""
    ops, streams, layer = NvidiaOps(), streams_view(9, n, 1100, dtype, seed=7), mixer(n, 1100, seed=8)
    pre, post, comb = ops.hc_mixes(streams, *layer, **KWARGS)
    collapsed, v4_post, v4_comb = ops.hc_pre(streams, *layer, **KWARGS)
    assert torch.equal(ops.hc_collapse(streams, pre), collapsed)
    assert torch.equal(post, v4_post) and torch.equal(comb, v4_comb)


@pytest.mark.parametrize("hidden", WIDTHS)
@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_hc_expand(tokens, dtype, n, hidden):
    block_out = randn(tokens, hidden + 4, dtype=dtype, seed=9)[:, :hidden]
    streams = streams_view(tokens, n, hidden, dtype, seed=10)
    post = 2 * randn(tokens, n, dtype=torch.float32, seed=11).sigmoid()
    comb = randn(tokens, n, n, dtype=torch.float32, seed=12).softmax(dim=-1)  # not symmetric
    out = NvidiaOps().hc_expand(block_out, streams, post, comb)
    assert_matches(out, REF.hc_expand(block_out, streams, post, comb), reduced=n + 1, roundings=1)


def test_hc_expand_rounds_once_where_hc_post_rounds_each_term():
    """bfloat16: V4.1's float32 sum differs from V4's rounded terms, and is the nearer to the exact value."""
    block_out, streams = randn(16, 48, dtype=torch.bfloat16, seed=13), streams_view(16, 4, 48, torch.bfloat16, 14)
    post = 2 * randn(16, 4, dtype=torch.float32, seed=15).sigmoid()
    comb = randn(16, 4, 4, dtype=torch.float32, seed=16).softmax(dim=-1)
    expand = NvidiaOps().hc_expand(block_out, streams, post, comb)
    v4 = NvidiaOps().hc_post(block_out, streams, post, comb)
    exact = REF.hc_expand(block_out.float(), streams.float(), post, comb)
    assert (expand.float() - exact).abs().mean() < (v4.float() - exact).abs().mean()


# ----------------------------------------------------------------------------- round_to_format

E4M3_VALUES = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448, ascending
TORCH_SATURATES = torch.tensor(500.0).to(torch.float8_e4m3fn).float().item() == 448.0  # torch >= 2.12


def blocks_of(values: torch.Tensor, block: int, peak: float) -> torch.Tensor:
    """values in blocks of `block` - 1, each block completed by `peak` (its amax, so the scale is known)."""
    rows = torch.nn.functional.pad(values, (0, (-values.numel()) % (block - 1)), value=0.0).view(-1, block - 1)
    return torch.cat([rows, torch.full((rows.shape[0], 1), peak)], dim=1).flatten()


def crafted(fmt: str) -> torch.Tensor:
    """Blocks that probe the format's edges: every tie and its neighbours at scale 1, both signs; amaxes at and
    just past the clamps (a scale rounded down: the clamp cuts), e4m3 scales at ties, normal and subnormal; tiny
    blocks (the scales' lower clamps, float32 subnormals); zeros and negative zeros."""
    block = int(fmt.rsplit(":", 1)[1])
    if fmt.startswith("fp8"):
        ties = (E4M3_VALUES[:-1] + E4M3_VALUES[1:]) / 2  # midpoints: in float32 exactly
        peak = 256.0  # every amax under 448: scale 1, the elements rounded to e4m3 as they are
    else:
        ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
        peak = 5.5 if fmt.endswith("pow2:32") else 6.0  # scale 1 both ways
    near = torch.cat([ties, ties.nextafter(torch.tensor(0.0)), ties.nextafter(torch.tensor(1e9))])
    parts = [blocks_of(torch.cat([near, -near]), block, peak)]
    clamps = (448.0, 448.0 * (1 + 2**-23), 448.0 * (1 - 2**-24), 448.0 * 2**-30, 1e-4, 1e-4 * 0.999, 6.0, 6 * 1.0000003)
    scale_ties = (6 * 1.0625, 6 * 1.1875, 6 * 3 * 2**-10)  # amax / 6 halfway between two e4m3 values
    tiny = (6 * 2**-126, 6 * 2**-9, 6 * 2**-9 * 1.001, 0.05, 1e-6)
    for amax in (*clamps, *scale_ties, *tiny):
        parts.append(blocks_of(torch.linspace(-amax, amax, block - 1), block, amax))
    parts.append(blocks_of(torch.tensor([1e-39, -3e-39, 2**-140, 0.0]), block, 1e-38))  # float32 subnormals
    parts.append(torch.zeros(block))
    parts.append(-torch.zeros(block))
    parts.append(torch.tensor([-0.0, 0.0, 1e-30] * block)[:block])
    return torch.cat(parts)


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor):
    """Every bit the same, NaNs aside: at the same places (their payloads are the platform's)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    nan = expected.isnan()
    assert torch.equal(actual.isnan(), nan)
    bits = torch.int32 if actual.dtype == torch.float32 else torch.int16
    mismatched = (actual.view(bits) != expected.view(bits)) & ~nan
    assert not mismatched.any(), f"{int(mismatched.sum())} differ: {actual[mismatched][:8]}, {expected[mismatched][:8]}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_round_to_format_crafted_blocks_bitwise(fmt, dtype):
    x = crafted(fmt).to(dtype)
    if dtype == torch.bfloat16:  # the interpreter's bfloat16 casts lose subnormals (the GPU's are exact)
        x = x.masked_fill((x.float().abs() < torch.finfo(torch.float32).tiny) & (x != 0), 0.0)
    assert_bitwise(NvidiaOps().round_to_format(x[None, :], fmt), REF.round_to_format(x[None, :], fmt))


@pytest.mark.parametrize("shape", [(5, 512), (3, 4, 128), (2, 96)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_round_to_format_random_bitwise(fmt, dtype, shape):
    """Magnitudes over 2^-40 .. 2^10 (so blocks of all scales), on a view with a row stride."""
    *rows, width = shape
    generator = torch.Generator().manual_seed(17)
    x = torch.randn(*rows, width + 32, generator=generator) * torch.exp2(torch.randint(-40, 11, (*rows, 1)).float())
    x = x.to(dtype)[..., :width]
    assert_bitwise(NvidiaOps().round_to_format(x, fmt), REF.round_to_format(x, fmt))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's, on the interpreter's inf and NaN arithmetic
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_round_to_format_nan_and_infinity_blocks(fmt):
    block = int(fmt.rsplit(":", 1)[1])
    x = torch.linspace(-3, 3, 4 * block)
    x[1], x[block + 2], x[2 * block + 3], x[3 * block] = float("nan"), float("inf"), float("-inf"), -0.0
    assert_bitwise(NvidiaOps().round_to_format(x, fmt), REF.round_to_format(x, fmt))


def test_round_to_format_saturates_the_e4m3_scale():
    """An amax past 6 x 464 rounds the e4m3 scale past 448: saturated to 448 (torch >= 2.12; older torch made a
    NaN of the block)."""
    x = torch.linspace(-1, 1, 16)
    x[3] = 3000.0  # scale e4m3(500) = 448; 3000 / 448 = 6.7 -> 6
    out = NvidiaOps().round_to_format(x, "fp4_e2m1/e4m3:16")
    assert out[3].item() == 6 * 448.0
    if TORCH_SATURATES:
        assert_bitwise(out, REF.round_to_format(x, "fp4_e2m1/e4m3:16"))


def test_round_to_format_refuses_what_the_reference_refuses():
    for x, fmt in ((torch.zeros(2, 32), "fp8_e4m3/pow2:64"), (torch.zeros(2, 48), "fp8_e4m3/pow2:32")):
        with pytest.raises(ValueError) as ours:
            NvidiaOps().round_to_format(x, fmt)
        with pytest.raises(ValueError) as theirs:
            REF.round_to_format(x, fmt)
        assert str(ours.value) == str(theirs.value)


# ----------------------------------------------------------------------------- engram


@pytest.mark.parametrize("hidden", WIDTHS)
@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 7])
def test_engram_gate(tokens, dtype, n, hidden):
    """key and value are views of one projection, as the model passes them; some tokens dead."""
    streams = streams_view(tokens, n, hidden, dtype, seed=18)
    kv = randn(tokens, (n + 1) * hidden, dtype=dtype, seed=19)
    key, value = kv[:, : n * hidden].unflatten(1, (n, hidden)), kv[:, n * hidden :]
    weight = randn(n, hidden, dtype=torch.float32, seed=20)
    dead = torch.arange(tokens) % 3 == 1
    out = NvidiaOps().engram_gate(streams, key, value, weight, dead, eps=1e-6)
    expected = REF.engram_gate(streams, key, value, weight, dead, eps=1e-6)
    assert_matches(out, expected, reduced=hidden, roundings=1)
    assert torch.equal(out[dead], streams[dead])  # a dead token's streams pass unchanged


# ----------------------------------------------------------------------------- batch invariance


@pytest.mark.usefixtures("fixed_order_dot")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_bitwise_equal_alone_and_in_a_batch_of_21(dtype):
    """Each op's result for a row, computed alone and as row 0, 5 or 20 of 21 rows: the same bits. The mixing
    GEMM is the batch-invariant mode's `linear`; the interpreter's dot sums in one order (conftest). 21 rows: the
    GEMM's interpreted row tiles are 16, so row 20 sits in a ragged second tile (as 36 of 37 did, at half the cost)."""
    ops, n, hidden, tokens = NvidiaOps(batch_invariant=True), 4, 300, 21  # two column blocks of hc_post
    streams, layer = streams_view(tokens, n, hidden, dtype, seed=21), mixer(n, hidden, seed=22)
    head = (randn(n, n * hidden, dtype=torch.float32, seed=23, scale=0.02), torch.ones(1), torch.zeros(n))
    block_out = randn(tokens, hidden, dtype=dtype, seed=24)
    kv = randn(tokens, (n + 1) * hidden, dtype=dtype, seed=25)
    key, value = kv[:, : n * hidden].unflatten(1, (n, hidden)), kv[:, n * hidden :]
    weight, dead = randn(n, hidden, dtype=torch.float32, seed=26), torch.arange(tokens) % 4 == 3
    pre, post, comb = ops.hc_mixes(streams, *layer, **KWARGS)

    def results(rows: slice) -> list[torch.Tensor]:
        return [
            *ops.hc_mixes(streams[rows], *layer, **KWARGS),
            *ops.hc_pre(streams[rows], *layer, **KWARGS),
            ops.hc_pre(streams[rows], *head, **KWARGS)[0],
            ops.hc_collapse(streams[rows], pre[rows]),
            ops.hc_expand(block_out[rows], streams[rows], post[rows], comb[rows]),
            ops.hc_post(block_out[rows], streams[rows], post[rows], comb[rows]),
            ops.round_to_format(kv[rows, : n * hidden], "fp4_e2m1/e4m3:16"),
            ops.engram_gate(streams[rows], key[rows], value[rows], weight, dead[rows], eps=1e-6),
        ]

    together = results(slice(None))
    for row in (0, 5, 20):
        for alone, batched in zip(results(slice(row, row + 1)), together):
            assert_bitwise(alone, batched[row : row + 1])


def test_empty_inputs():
    ops, streams = NvidiaOps(), torch.empty(0, 4, 48)
    pre, post, comb = ops.hc_mixes(streams, *mixer(4, 48, seed=27), **KWARGS)
    assert pre.shape == post.shape == (0, 4) and comb.shape == (0, 4, 4)
    assert ops.hc_collapse(streams, pre).shape == (0, 48)
    assert ops.hc_expand(torch.empty(0, 48), streams, post, comb).shape == (0, 4, 48)
    assert ops.round_to_format(torch.empty(0, 64), "fp8_e4m3/pow2:32").shape == (0, 64)
    dead = torch.empty(0, dtype=torch.bool)
    assert ops.engram_gate(streams, streams, torch.empty(0, 48), torch.ones(4, 48), dead, eps=1e-6).shape == (0, 4, 48)
