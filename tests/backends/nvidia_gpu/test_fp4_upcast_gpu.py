"""On a GPU only (skipped elsewhere): the MXFP4 upcast the decode-sized expert tiles run (quant.mxfp4_upcast, inline
PTX the interpreter cannot run), against the reference's `dequantize` bit for bit: every byte (both nibbles, all 16
codes, signed zeros) under scale bytes from 0 (2^-127, a subnormal scale) to 254; and the expert FFN that uses it
against the same experts dequantized, at decode sizes."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from deepinfer_core.backend.ops import MXFP4  # noqa: E402
from deepinfer_core.kv.formats import e2m1_values  # noqa: E402
from deepinfer_nvidia_sm100.kernels import moe, quant  # noqa: E402

SCALE_BYTES = (0, 1, 2, 3, 64, 100, 120, 126, 127, 128, 129, 150, 200, 250, 253, 254)  # 16: a power of two of bytes


@triton.jit
def _upcast_kernel(packed_ptr, scale_ptr, low_ptr, high_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    low, high = quant.mxfp4_upcast(tl.load(packed_ptr + i), tl.load(scale_ptr + i))
    tl.store(low_ptr + i, low)
    tl.store(high_ptr + i, high)


def test_every_byte_and_scale_upcasts_to_the_dequantized_bf16():
    n = 256 * len(SCALE_BYTES)
    packed = torch.arange(256, dtype=torch.uint8).repeat(len(SCALE_BYTES))
    scales = torch.tensor(SCALE_BYTES, dtype=torch.uint8).repeat_interleave(256)
    low = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    high = torch.empty_like(low)
    _upcast_kernel[(1,)](packed.cuda(), scales.cuda(), low, high, N=n)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=1)  # low nibble first, as MXFP4 packs K
    want = (e2m1_values(codes) * scales.view(torch.float8_e8m0fnu).float()[:, None]).to(torch.bfloat16)
    got = torch.stack([low.cpu(), high.cpu()], dim=1)
    wrong = (got.view(torch.int16) != want.view(torch.int16)).nonzero().tolist()
    assert not wrong, [(int(packed[i]), int(scales[i]), j, float(got[i, j]), float(want[i, j])) for i, j in wrong[:8]]


@pytest.mark.parametrize("counts", [[1, 0, 1, 1], [3, 0, 21, 1], [7, 9, 0, 40]], ids=["batch1", "mixed", "more"])
def test_decode_sized_fp4_expert_ffn_is_the_dequantized_ffn(counts):
    """Fewer than 16 rows an expert on average: the 16-row tiles with the upcast (default mode); the result is the
    dequantized experts' FFN up to float32 summation order (the tile shapes differ from bf16's)."""
    counts = torch.tensor(counts)
    g = torch.Generator(device="cuda").manual_seed(int(counts.sum()))
    x = torch.randn(int(counts.sum()), 512, generator=g, device="cuda").to(torch.bfloat16)
    w13 = MXFP4.quantize(torch.randn(4, 768, 512, generator=g, device="cuda") * 0.05)
    w2 = MXFP4.quantize(torch.randn(4, 512, 384, generator=g, device="cuda") * 0.05)
    got = moe.expert_ffn(x, counts.cuda(), w13, w2, fixed_tiles=False, swiglu_limit=10.0)
    want = moe.expert_ffn(x, counts.cuda(), w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16),
                          fixed_tiles=True, swiglu_limit=10.0)  # fmt: skip
    scale = float(want.float().abs().max())
    assert float((got.float() - want.float()).abs().max()) <= 2**-6 * scale
    again = moe.expert_ffn(x[: int(counts[0])], counts.cuda() * (torch.arange(4).cuda() == 0), w13, w2,
                           fixed_tiles=False, swiglu_limit=10.0)  # fmt: skip
    assert torch.equal(again, got[: int(counts[0])])  # a row's result is its own: other experts' rows change nothing
