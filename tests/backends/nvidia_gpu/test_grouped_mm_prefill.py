"""On a GPU only (skipped elsewhere; CI has none): expert_ffn at prefill sizes in default mode runs through
torch._grouped_mm and agrees with the reference ops, with V4's swiglu limit and V4.1's row scales; batch-
invariant mode (fixed tiles) never takes it."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip(
        "needs a CUDA GPU (the kernels are checked under Triton's interpreter elsewhere)", allow_module_level=True
    )

from deepinfer_core.reference.ops import ReferenceOps  # noqa: E402
from deepinfer_nvidia_sm100.kernels import moe  # noqa: E402

EXPERTS, HIDDEN, INNER = 8, 1024, 512


def _case(seed: int, rows_per_expert: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    counts = torch.full((EXPERTS,), rows_per_expert, device="cuda", dtype=torch.int64)
    counts[1] += 37  # uneven groups
    counts[5] = 0  # an expert nobody chose
    x = torch.randn(int(counts.sum()), HIDDEN, generator=g, device="cuda").bfloat16()
    w13 = (torch.randn(EXPERTS, 2 * INNER, HIDDEN, generator=g, device="cuda") * HIDDEN**-0.5).bfloat16()
    w2 = (torch.randn(EXPERTS, HIDDEN, INNER, generator=g, device="cuda") * INNER**-0.5).bfloat16()
    scales = torch.rand(x.shape[0], generator=g, device="cuda")
    return x, counts, w13, w2, scales


@pytest.mark.parametrize("limit", [None, 1.5])
@pytest.mark.parametrize("row_scaled", [False, True])
def test_prefill_sizes_take_torch_grouped_mm_and_agree_with_the_reference(monkeypatch, limit, row_scaled):
    x, counts, w13, w2, scales = _case(0, 2 * moe.LARGE_ROWS_PER_EXPERT)  # past the threshold with one expert idle
    calls = []
    grouped = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or grouped(*a, **k))
    kwargs = dict(swiglu_limit=limit, row_scales=scales if row_scaled else None)
    got = moe.expert_ffn(x, counts, w13, w2, fixed_tiles=False, **kwargs)
    assert len(calls) == 2, "the prefill-sized call did not go through torch._grouped_mm"
    want = ReferenceOps().expert_ffn(x, counts, w13, w2, **kwargs)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    calls.clear()
    fixed = moe.expert_ffn(x, counts, w13, w2, fixed_tiles=True, **kwargs)  # batch-invariant mode: our tiles
    assert not calls
    torch.testing.assert_close(fixed.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_decode_sizes_stay_on_the_triton_kernels(monkeypatch):
    x, counts, w13, w2, _ = _case(1, 2)
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: pytest.fail("decode-sized call took _grouped_mm"))
    got = moe.expert_ffn(x, counts, w13, w2, fixed_tiles=False)
    torch.testing.assert_close(got.float(), ReferenceOps().expert_ffn(x, counts, w13, w2).float(), atol=2e-2, rtol=2e-2)
