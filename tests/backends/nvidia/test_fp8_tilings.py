"""The default mode's FP8 tiling table (kernels/fp8_tilings): which tiling a row count and weight shape get, and
that every tiling in it is one the GEMM takes for the block sizes DeepSeek ships (128 and 32 columns)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.backend.ops import BlockFP8
from deepinfer_nvidia_sm100.kernels import fp8_tilings, gemm, quant
from tests.backends.nvidia.test_dense_kernels import REF, assert_matches, randn

ALL = [(shape, m) for shape, table in fp8_tilings.MEASURED.items() for m in table]
SHAPE = (4096, 8192)  # V4 Flash's o_b


def keywords(spec) -> dict:
    tiles, waves, stages = spec
    return {"tiles": tiles, "waves": waves, "stages": stages}


@pytest.mark.parametrize("shape,rows", ALL, ids=[f"{n}x{k}_rows{m}" for (n, k), m in ALL])
def test_a_measured_row_count_takes_its_own_entry(shape, rows):
    assert fp8_tilings.tiling(rows, *shape) == keywords(fp8_tilings.MEASURED[shape][rows])


@pytest.mark.parametrize("rows,bucket", [(2, 16), (16, 16), (17, 32), (33, 64), (64, 64), (65, 128)])
def test_other_row_counts_take_the_next_measured_count_up(rows, bucket):
    assert fp8_tilings.tiling(rows, *SHAPE) == keywords(fp8_tilings.MEASURED[SHAPE][bucket])


def test_past_the_largest_measured_count_every_shape_takes_the_prefill_tiling():
    for shape in [*fp8_tilings.MEASURED, (7168, 1536)]:
        largest = max(fp8_tilings.MEASURED.get(shape, fp8_tilings.GENERIC))
        assert fp8_tilings.tiling(largest + 1, *shape) == keywords(fp8_tilings.PREFILL)
        assert fp8_tilings.tiling(8192, *shape) == keywords(fp8_tilings.PREFILL)


def test_an_unmeasured_shape_takes_the_generic_table():
    assert (7168, 1536) not in fp8_tilings.MEASURED  # V3's q_b: not one of V4 Flash's shapes
    for rows in (1, 9, 30, 60, 100, 256):
        bucket = min(m for m in fp8_tilings.GENERIC if m >= rows)
        assert fp8_tilings.tiling(rows, 7168, 1536) == keywords(fp8_tilings.GENERIC[bucket])


@pytest.mark.parametrize("block", [128, 32])
def test_every_tiling_takes_the_shipped_scale_blocks(block):
    tables = [*fp8_tilings.MEASURED.values(), fp8_tilings.GENERIC]
    specs = [s for table in tables for s in table.values()] + [fp8_tilings.PREFILL]
    weight = BlockFP8.quantize(torch.ones(block, block), (block, block), "e8m0")
    for (bm, bn, bk, warps), waves, stages in specs:
        quant.check_tiles(quant.weight_args(weight), bk)  # raises where the blocks neither span nor divide
        assert bm in (16, 32, 64, 128) and bn in (32, 64, 128) and warps in (2, 4, 8) and waves >= 1 and stages >= 1


TILINGS = sorted({s for table in [*fp8_tilings.MEASURED.values(), fp8_tilings.GENERIC] for s in table.values()})
TILING_IDS = [f"bm{t[0]}_bn{t[1]}_bk{t[2]}_w{t[3]}_waves{w}_s{s}" for t, w, s in TILINGS]


@pytest.mark.parametrize("spec", TILINGS, ids=TILING_IDS)
def test_every_tiling_of_the_table_is_the_dequantized_gemm(spec):
    """Each tiling the table holds (under the interpreter: tiles, K splits and their sum; warps and stages are the
    GPU's), on a weight whose rows and K end inside a tile and a scale block."""
    weight = BlockFP8.quantize(randn(200, 640, dtype=torch.float32, seed=21, scale=0.2), (128, 128), "e8m0")
    x = randn(19, 640, dtype=torch.bfloat16, seed=22)
    tiles, waves, stages = spec
    got = gemm.batched_matmul(x[None], weight.weight[None], b_scale=weight, tiles=tiles, waves=waves, stages=stages)
    assert_matches(got[0], REF.linear(x, weight), reduced=640, roundings=2)


def test_the_gemm_routes_fp8_weights_through_the_table(monkeypatch):
    seen = []
    monkeypatch.setattr(fp8_tilings, "tiling", lambda rows, n, k: seen.append((rows, n, k)) or {})
    weight = BlockFP8.quantize(torch.randn(64, 256), (128, 128), "e8m0")
    gemm.matmul(torch.randn(3, 256), weight, fixed_tiles=False)
    gemm.matmul(torch.randn(3, 256), weight, fixed_tiles=True)  # the batch-invariant mode: one fixed tiling
    assert seen == [(3, 64, 256)]
