"""On a GPU only (skipped elsewhere): every tiling of the default mode's FP8 table (kernels/fp8_tilings) at V4
Flash's projection shapes gives the GEMM of the dequantized weight (within bf16 roundings: the kernel never rounds
the dequantized weight's products the way cuBLAS orders them), at each measured row count and one between."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402

from deepinfer_core.backend.ops import BlockFP8  # noqa: E402
from deepinfer_nvidia_sm100.kernels import fp8_tilings, gemm  # noqa: E402


@pytest.mark.parametrize("n,k", list(fp8_tilings.MEASURED), ids=lambda v: str(v))
def test_each_tiling_of_the_table_is_the_dequantized_gemm(n, k):
    g = torch.Generator(device="cuda").manual_seed(n + k)
    weight = BlockFP8.quantize(torch.randn(n, k, generator=g, device="cuda") * k**-0.5, (128, 128), "e8m0")
    dense = weight.dequantize().to(torch.bfloat16)
    for rows in (1, 5, 16, 24, 32, 48, 64, 100, 128, 200, 256, 300):
        x = torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16)
        want = F.linear(x.float(), dense.float())
        got = gemm.matmul(x, weight, fixed_tiles=False).float()
        err = (got - want).abs().max() / want.abs().max()
        assert err < 2e-2, (
            f"rows={rows}: max error {err:.3g} of the largest output, tiling {gemm.quantized_tiling(rows, weight)}"
        )
