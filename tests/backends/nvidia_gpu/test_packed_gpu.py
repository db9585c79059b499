"""On a GPU only (skipped elsewhere): DeepSeek-V4.1's packed caches at V4.1 Flash's widths, compiled for the GPU.
The write kernel stores kv.formats.pack's bytes (torch's CUDA float8 casts against the kernel's integer
rounding, subnormals included, which the interpreter cannot widen from bfloat16), and gather reads them back."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from deepinfer_core.kv.formats import BLOCK_FORMATS, pack, round_blocks  # noqa: E402
from deepinfer_core.kv.layout import CacheKind, CacheSpec  # noqa: E402
from deepinfer_nvidia_sm100.kv import NvidiaKVLayout  # noqa: E402

DIMS = {"fp8_e4m3/pow2:32": 512, "fp4_e2m1/e4m3:16": 512, "fp4_e2m1/pow2:32": 128}  # window, entries, index keys


def _inputs(rows: int, dim: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(dim)
    x = torch.randn(rows, dim, generator=g, device="cuda")
    x *= 10 ** (torch.rand(rows, 1, generator=g, device="cuda") * 40 - 38)  # 1e-38 .. 1e2 by row
    x *= 10 ** (-6 * torch.rand(rows, dim, generator=g, device="cuda"))  # and by element
    x[0] = 0.0
    x[1, :16], x[1, 1:16:2] = 0.0176, -0.004  # a subnormal e4m3 scale whose largest element rounds to 4
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_the_write_kernel_stores_kv_formats_bytes(fmt, dtype):
    dim = DIMS[fmt]
    spec = CacheSpec(CacheKind.PAGED, dtype, 1, dim, compress_rate=4, stored_format=fmt)
    layout = NvidiaKVLayout(torch.device("cuda"), 128)
    cache = layout.allocate(spec, 64)
    slots = torch.randperm(cache.shape[0], device="cuda")[:1024]
    for x in (_inputs(1024, dim).to(dtype), round_blocks(_inputs(1024, dim).to(dtype), fmt)):
        layout.write(cache, spec, slots, x[:, None, :])
        assert torch.equal(cache[slots], pack(x, fmt))
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(layout.gather(cache, spec, slots)[:, 0].view(bits), x.view(bits))
