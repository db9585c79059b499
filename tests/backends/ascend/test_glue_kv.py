"""AscendKVLayout: write/gather round trips through npu_scatter_nd_update_, and the block-major part views that
npu_fused_infer_attention_score reads.

These are glue tests on CPU against a fake torch_npu written from its documentation — not evidence that the
backend runs on Ascend hardware.
"""

from __future__ import annotations

import pytest
import torch
from fake_torch_npu import FakeTorchNpu

from deepinfer_ascend950.kv import AscendKVLayout
from deepinfer_core.kv.layout import CacheKind, CacheSpec

CPU = torch.device("cpu")
BLOCK = 128
NUM_BLOCKS = 5
SPECS = {
    "mla_parts": dict(num_heads=1, head_dim=80, parts=(64, 16)),
    "one_part": dict(num_heads=2, head_dim=64, parts=()),
}


def _setup(case: str, dtype: torch.dtype, seed: int):
    spec = CacheSpec(kind=CacheKind.PAGED, dtype=dtype, **SPECS[case])
    npu = FakeTorchNpu()
    layout = AscendKVLayout(npu, CPU, BLOCK)
    cache = layout.allocate(spec, NUM_BLOCKS)
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=g)[:300]  # distinct, shuffled, over all blocks
    values = torch.randn(300, spec.num_heads, spec.head_dim, generator=g)
    return spec, npu, layout, cache, slots, values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", SPECS)
def test_write_gather_round_trip(case, dtype):
    spec, npu, layout, cache, slots, values = _setup(case, dtype, seed=1)
    assert torch.equal(cache, torch.zeros_like(cache))
    layout.write(cache, spec, slots, values)  # float32 values into a `dtype` cache: cast on write
    got = layout.gather(cache, spec, slots)
    assert got.shape == (300, spec.num_heads, spec.head_dim) and got.dtype == dtype
    assert torch.equal(got, values.to(dtype))
    unwritten = torch.ones(NUM_BLOCKS * BLOCK, dtype=torch.bool)
    unwritten[slots] = False
    assert not layout.gather(cache, spec, unwritten.nonzero()[:, 0]).any()
    # one scatter per part, [N, 1] int64 indices into [blocks * block_size, Hkv * part] rows
    parts = spec.parts or (spec.head_dim,)
    scatters = npu.calls_of("npu_scatter_nd_update_")
    assert len(scatters) == len(parts)
    for call, part in zip(scatters, parts):
        assert call.args["indices"].shape == (300, 1) and call.args["indices"].dtype == torch.int64
        assert call.args["updates"].shape == (300, spec.num_heads * part)


@pytest.mark.parametrize("case", SPECS)
def test_overwrite_keeps_the_last_value(case):
    spec, _, layout, cache, slots, values = _setup(case, torch.float32, seed=2)
    layout.write(cache, spec, slots, values)
    layout.write(cache, spec, slots[:50], -values[:50])
    expected = torch.cat([-values[:50], values[50:]])
    assert torch.equal(layout.gather(cache, spec, slots), expected)


@pytest.mark.parametrize("case", SPECS)
def test_part_views_are_contiguous_block_major_and_disjoint(case):
    spec, _, layout, cache, slots, values = _setup(case, torch.float32, seed=3)
    layout.write(cache, spec, slots, values)
    views = layout.parts(cache, spec)
    parts = spec.parts or (spec.head_dim,)
    assert len(views) == len(parts)
    start, first = 0, 0  # storage offset of the view, first entry dim of the part
    for view, part in zip(views, parts):
        assert view.is_contiguous()
        assert view.shape == (NUM_BLOCKS, BLOCK, spec.num_heads * part)
        assert view.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
        assert view.storage_offset() == start  # the parts one after another, no overlap, no gap
        start += view.numel()
        # block-major: view[b, o] holds the entry of slot b * block_size + o, heads side by side
        blocks, offsets = slots // BLOCK, slots % BLOCK
        expected = values[..., first : first + part].reshape(300, -1)
        assert torch.equal(view[blocks, offsets], expected)
        first += part
    assert start == cache.numel()


def test_only_paged_caches():
    layout = AscendKVLayout(FakeTorchNpu(), CPU, BLOCK)
    spec = CacheSpec(kind=CacheKind.SLIDING_WINDOW, dtype=torch.bfloat16, num_heads=1, head_dim=8, window=128)
    with pytest.raises(ValueError, match="paged"):
        layout.allocate(spec, 2)
