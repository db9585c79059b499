"""The quantized weight formats (backend/weight_formats.py) against values worked out by hand: every e2m1 code,
E8M0 scale bytes at both ends and NaN, DeepSeek's scale rules, round trips, and stacking."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer_core.backend.weight_formats import (
    MXFP4,
    BlockFP8,
    concat_rows,
    dequantized,
    stack,
    weight_format,
)

E8M0 = torch.float8_e8m0fnu
E2M1_BY_CODE = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


def scale_bytes(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8).view(E8M0)


def mxfp4_row(codes: list[int], scale_byte: int) -> MXFP4:
    """One row of 32 e2m1 codes (code 2i in byte i's low nibble), one scale."""
    packed = [codes[i] | codes[i + 1] << 4 for i in range(0, 32, 2)]
    return MXFP4(torch.tensor([packed], dtype=torch.uint8), scale_bytes(scale_byte).reshape(1, 1))


def test_every_e2m1_code_dequantizes_to_its_value_low_nibble_first():
    codes = list(range(16)) * 2
    values = mxfp4_row(codes, 127).dequantize()  # scale 2^0
    assert values.shape == (1, 32)
    assert values[0].tolist() == E2M1_BY_CODE * 2
    assert math.copysign(1, values[0, 8].item()) == -1  # code 8 is -0.0
    assert mxfp4_row(codes, 129).dequantize()[0].tolist() == [4 * v for v in E2M1_BY_CODE] * 2  # 2^2
    assert mxfp4_row(codes, 126).dequantize()[0].tolist() == [v / 2 for v in E2M1_BY_CODE] * 2  # 2^-1
    byte = mxfp4_row([3, 12] + [0] * 30, 127)
    assert byte.weight[0, 0].item() == 0xC3 and byte.dequantize()[0, :2].tolist() == [1.5, -2.0]


def test_e8m0_scale_extremes_and_nan():
    codes = [7, 1] + [0] * 30  # 6 and 0.5
    smallest = mxfp4_row(codes, 0).dequantize()[0]  # byte 0 = 2^-127 (a float32 subnormal)
    assert smallest[:2].tolist() == [6 * 2.0**-127, 2.0**-128]
    largest = mxfp4_row([1] + [0] * 31, 254).dequantize()[0]  # byte 254 = 2^127
    assert largest[0].item() == 2.0**126
    assert mxfp4_row(codes, 254).dequantize()[0, 0].item() == math.inf  # 6 * 2^127 is past float32's range
    assert mxfp4_row(codes, 255).dequantize()[0].isnan().all()  # byte 255 is NaN: the whole block
    fp8 = BlockFP8(torch.tensor([[448.0, 1.0]]).to(torch.float8_e4m3fn), scale_bytes(130).reshape(1, 1), (1, 2))
    assert fp8.pow2_scales and fp8.dequantize().tolist() == [[448.0 * 8, 8.0]]
    nan_code = BlockFP8(torch.tensor([[0x7F, 0x38]], dtype=torch.uint8).view(torch.float8_e4m3fn),
                        scale_bytes(127).reshape(1, 1), (1, 2))  # fmt: skip
    assert nan_code.dequantize()[0, 0].isnan() and nan_code.dequantize()[0, 1].item() == 1.0
    nan_scale = BlockFP8(fp8.weight, scale_bytes(255).reshape(1, 1), (1, 2))
    assert nan_scale.dequantize().isnan().all()


def test_mxfp4_quantize_picks_the_smallest_unclipped_power_of_two_and_rounds_ties_to_even():
    block = torch.zeros(2, 32)
    # amax 6: scale 1. 0.25 ties 0 / 0.5 -> 0 (even code); 0.75 ties 0.5 / 1 -> 1; 5 ties 4 / 6 -> 4; 2.5 -> 2
    block[0, :8] = torch.tensor([6, -3, 0.25, 0.75, 5, 2.5, -1.25, 1.75])
    # amax 7: scale 2^ceil(log2(7/6)) = 2; 7/2 = 3.5 ties 3 / 4 -> 4 (8); 1 / 2 = 0.5; -0.2 / 2 = -0.1 -> +0
    block[1, :3] = torch.tensor([7, 1, -0.2])
    q = MXFP4.quantize(block)
    assert q.scale.view(torch.uint8).flatten().tolist() == [127, 128]
    assert q.dequantize()[0, :8].tolist() == [6, -3, 0, 1, 4, 2, -1, 2]
    assert q.dequantize()[1, :3].tolist() == [8, 1, 0]
    assert math.copysign(1, q.dequantize()[1, 2].item()) == 1  # a zero result is +0 (code 0, not 8)
    assert q.weight[0, 0].item() == 0xD7  # 6 = code 7 (low nibble), -3 = code 13 (high)
    zeros = MXFP4.quantize(torch.zeros(1, 32))  # amax 0: the floor 6 * 2^-126 gives the scale 2^-126 (byte 1)
    assert zeros.scale.view(torch.uint8).item() == 1 and not zeros.dequantize().any()


def test_mxfp4_round_trips_values_already_in_the_format():
    gen = torch.Generator().manual_seed(0)
    original = MXFP4(torch.randint(0, 256, (4, 3, 32), generator=gen, dtype=torch.uint8),
                     torch.randint(100, 150, (4, 3, 2), generator=gen, dtype=torch.uint8).view(E8M0))  # fmt: skip
    values = original.dequantize()
    again = MXFP4.quantize(values)
    assert again.shape == values.shape == (4, 3, 64)
    assert torch.equal(again.dequantize(), values)


def test_fp8_blocks_with_e8m0_scales_use_deepseeks_ue8m0_rule():
    w = torch.tensor([[448.0, 1.0, 500.0, 0.0], [-224.0, 0.5, 3.0, -2.0]])
    q = BlockFP8.quantize(w, block=(2, 2), scales="e8m0")
    # block 0: amax 448 -> 2^ceil(log2(1)) = 1 (byte 127); block 1: 500 / 448 -> 2 (byte 128)
    assert q.scale.dtype == E8M0 and q.scale.view(torch.uint8).tolist() == [[127, 128]]
    # 500 / 2 = 250 lies between e4m3's 240 and 256 (steps of 16 there): 256, times 2
    assert q.dequantize().tolist() == [[448.0, 1.0, 512.0, 0.0], [-224.0, 0.5, 3.0, -2.0]]
    float_scales = BlockFP8.quantize(w, block=(2, 2))
    assert float_scales.scale.dtype == torch.float32 and float_scales.scale[0, 1].item() == pytest.approx(500 / 448)
    v32 = torch.randn(64, 96, generator=torch.Generator().manual_seed(1))
    blocks32 = BlockFP8.quantize(v32, block=(32, 32), scales="e8m0")
    assert blocks32.scale.shape == (2, 3)
    assert torch.equal(BlockFP8.quantize(blocks32.dequantize(), (32, 32), "e8m0").dequantize(), blocks32.dequantize())
    with pytest.raises(ValueError, match="'float32' or 'e8m0'"):
        BlockFP8.quantize(w, block=(2, 2), scales="e5m2")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_quantizing_a_weight_that_is_not_finite_is_refused(bad):
    w = torch.ones(2, 32)
    w[1, 3] = bad
    for quantize in (MXFP4.quantize, BlockFP8.quantize):
        with pytest.raises(ValueError, match="NaN or infinite"):
            quantize(w)


def test_mxfp4_needs_whole_blocks_of_32_along_k():
    with pytest.raises(ValueError, match="multiple"):
        MXFP4.quantize(torch.ones(2, 48))


def test_concat_and_stack_keep_a_format_only_when_every_part_has_it():
    gen = torch.Generator().manual_seed(2)
    gate, up, down = (torch.randn(64, 64, generator=gen) for _ in range(3))
    g4, u4, d4 = MXFP4.quantize(gate), MXFP4.quantize(up), MXFP4.quantize(down)
    both = concat_rows([g4, u4], torch.float32)
    assert weight_format(both) == "mxfp4" and both.shape == (128, 64)
    assert torch.equal(both.dequantize(), torch.cat([g4.dequantize(), u4.dequantize()]))
    experts = stack([d4, d4], torch.float32)
    assert weight_format(experts) == "mxfp4" and experts.shape == (2, 64, 64)
    mixed = concat_rows([g4, BlockFP8.quantize(up, (32, 32), "e8m0")], torch.bfloat16)
    assert weight_format(mixed) == "bfloat16"
    assert torch.equal(mixed[:64], g4.dequantize(torch.bfloat16))
    scales_differ = stack([BlockFP8.quantize(up, (32, 32)), BlockFP8.quantize(up, (32, 32), "e8m0")], torch.float32)
    assert weight_format(scales_differ) == "float32"
    assert dequantized(gate, torch.float32) is gate
