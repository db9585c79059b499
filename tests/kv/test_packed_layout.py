"""Block formats as bytes (kv.formats.pack / unpack) and PackedKVLayout: values already in a format come back bit
for bit from its packed rows, at the format's size; caches without a format are stored as the reference does."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.kv import formats
from deepinfer_core.kv.caches import block_bytes, sequence_bytes
from deepinfer_core.kv.formats import BLOCK_FORMATS, BlockFormat, pack, round_blocks, unpack
from deepinfer_core.kv.layout import CacheKind, CacheSpec
from deepinfer_core.kv.packed import PackedKVLayout

CPU = torch.device("cpu")
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def inputs(rows: int, dim: int, seed: int) -> torch.Tensor:
    """Random rows from 1e-30 to 1e8, a zero row, one far below every scale's floor, one of mixed magnitudes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=g) * torch.logspace(-30, 8, rows)[:, None]
    x[0], x[1] = 0.0, torch.randn(dim, generator=g) * 1e-39
    x[2] = torch.randn(dim, generator=g) * torch.logspace(-6, 6, dim)
    return x


@pytest.mark.parametrize("dtype", BITS, ids=str)
@pytest.mark.parametrize("name", BLOCK_FORMATS)
def test_values_in_the_format_come_back_bit_for_bit(name, dtype):
    for seed in range(8):
        rounded = round_blocks(inputs(120, 64, seed).to(dtype), name)
        rows = pack(rounded, name)
        assert rows.dtype == torch.uint8 and rows.shape == (120, BlockFormat.of(name).row_bytes(64))
        back = unpack(rows, name, dtype)
        assert torch.equal(back.view(BITS[dtype]), rounded.view(BITS[dtype])), seed


@pytest.mark.parametrize("name", BLOCK_FORMATS)
def test_packing_rounds_like_round_to_format(name):
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1)) * 3
    assert torch.equal(unpack(pack(x, name), name, torch.float32), round_blocks(x, name))


def test_a_subnormal_e4m3_scale_whose_largest_element_rounded_to_4_keeps_its_scale():
    """amax ~ 4.5 x 2 x 2^-9: the scale rounds to 2 x 2^-9 and the largest element to 4, so the amax rule on the
    rounded block would pick 2^-9 (under which 8 x 2^-9 does not fit): pack must take amax / 4 instead."""
    block = torch.full((1, 16), 0.0176)
    block[0, 1::2] = -0.004
    rounded = round_blocks(block, "fp4_e2m1/e4m3:16")
    fmt = BlockFormat.of("fp4_e2m1/e4m3:16")
    rule = formats._scales(fmt, rounded.view(1, 1, 16))
    assert not formats._holds(rounded.view(1, 1, 16), rule)  # the case the fallback is for
    assert torch.equal(unpack(pack(rounded, fmt.name), fmt.name, torch.float32), rounded)


def test_a_zero_row_is_zeros_and_sizes_are_the_formats():
    assert torch.equal(
        unpack(torch.zeros(2, 66, dtype=torch.uint8), "fp8_e4m3/pow2:32", torch.float32), torch.zeros(2, 64)
    )
    assert [BlockFormat.of(n).row_bytes(512) for n in BLOCK_FORMATS] == [512 + 16, 256 + 16, 256 + 32]


def test_cache_specs_refuse_a_stored_format_they_cannot_hold():
    with pytest.raises(ValueError, match="unknown block format 'fp6'"):
        CacheSpec(CacheKind.PAGED, torch.bfloat16, 1, 64, stored_format="fp6")
    with pytest.raises(ValueError, match="blocks of 32 along the last dim, which is 48 here"):
        CacheSpec(CacheKind.PAGED, torch.bfloat16, 1, 48, stored_format="fp8_e4m3/pow2:32")
    with pytest.raises(ValueError, match="SEQUENCE_STATE cache has no stored_format"):
        CacheSpec(CacheKind.SEQUENCE_STATE, torch.float32, state_shape=(2, 32), stored_format="fp8_e4m3/pow2:32")


def test_the_layout_packs_formatted_caches_and_keeps_the_others():
    layout = PackedKVLayout(CPU, block_size=16)
    window = CacheSpec(CacheKind.SLIDING_WINDOW, torch.bfloat16, 1, 64, window=8, rollback_slots=2,
                       stored_format="fp8_e4m3/pow2:32")  # fmt: skip
    entries = CacheSpec(CacheKind.PAGED, torch.bfloat16, 1, 64, compress_rate=4, stored_format="fp4_e2m1/e4m3:16")
    plain = CacheSpec(CacheKind.PAGED, torch.bfloat16, 2, 64)
    ring, comp, kv = layout.allocate(window, 3), layout.allocate(entries, 5), layout.allocate(plain, 5)
    assert (ring.shape, ring.dtype, comp.shape, kv.shape, kv.dtype) == (
        (30, 66),
        torch.uint8,
        (20, 36),
        (80, 2, 64),
        torch.bfloat16,
    )
    assert [layout.entry_bytes(s) for s in (window, entries, plain)] == [66, 36, 256]
    values = round_blocks(inputs(7, 64, 3).to(torch.bfloat16), window.stored_format)[:, None, :]
    slots = torch.tensor([29, 0, 11, 12, 5, 17, 3])
    layout.write(ring, window, slots, values)
    assert torch.equal(layout.gather(ring, window, slots).view(torch.int16), values.view(torch.int16))
    assert torch.equal(layout.gather(ring, window, torch.tensor([1, 2])), torch.zeros(2, 1, 64, dtype=torch.bfloat16))
    # core sizes the caches by the layout's bytes: the packed window is 66 bytes a slot, not 128
    specs = [{"window": window, "compressed": entries, "kv": plain}]
    assert sequence_bytes(specs, layout) == 10 * 66 and sequence_bytes(specs) == 10 * 128
    assert block_bytes(specs, 16, layout) == 4 * 36 + 16 * 256 and block_bytes(specs, 16) == 4 * 128 + 16 * 256
