"""The default mode's tilings of FP8 projections (ops.BlockFP8 weights in `gemm.matmul`), per weight shape and row
count, as vLLM keeps tuned configs per (N, K) and batch size for its block-FP8 kernels.

MEASURED: V4 Flash's seven dense projection shapes, each tiling the fastest of a grid on the H200 with the weight
read from HBM, as a model's step reads it (bench/gpu_fp8_tilings.py: bench/results/gpu_fp8_tilings_nvidia_h200.json,
then a wider grid up to 64 rows, bench/results/gpu_fp8_tilings_small_nvidia_h200.json, whose picks replace an entry
only where they beat it in that run; regenerate with `python bench/gpu_fp8_tilings.py --table RESULT [RESULT ...]
--write`). A row count takes the entry of the
smallest measured count at or above it. Other shapes take GENERIC: per row count the one tiling fastest over the
seven shapes together. Past the largest measured count (prefill chunks) every shape takes PREFILL, the 128 x 128
tiling the default mode used from 128 rows before the table.

The tiling follows the rows, so results are not batch-invariant (the batch-invariant mode keeps one fixed
tiling); each tiling is deterministic (its K splits depend on the shape only).
"""

from __future__ import annotations

Tiling = tuple[tuple[int, int, int, int], int, int]  # ((BM, BN, BK, warps), waves, stages)

PREFILL: Tiling = ((128, 128, 64, 8), 1, 3)

# --- the table (bench/gpu_fp8_tilings.py --table) ---
MEASURED: dict[tuple[int, int], dict[int, Tiling]] = {
    (1024, 4096): {
        1: ((16, 64, 128, 4), 1, 4),
        16: ((16, 64, 128, 4), 2, 4),
        32: ((32, 64, 64, 4), 1, 4),
        64: ((64, 64, 128, 4), 1, 4),
        128: ((128, 64, 128, 4), 2, 3),
        256: ((128, 64, 64, 8), 1, 4),
    },
    (32768, 1024): {
        1: ((16, 64, 256, 2), 2, 3),
        16: ((16, 32, 128, 2), 1, 3),
        32: ((32, 64, 64, 4), 1, 4),
        64: ((64, 64, 64, 4), 1, 4),
        128: ((128, 64, 64, 4), 1, 4),
        256: ((128, 64, 64, 4), 1, 3),
    },
    (512, 4096): {
        1: ((16, 32, 128, 4), 4, 5),
        16: ((16, 32, 128, 4), 2, 4),
        32: ((32, 32, 128, 4), 4, 4),
        64: ((64, 32, 128, 4), 1, 4),
        128: ((64, 64, 128, 4), 2, 3),
        256: ((128, 64, 128, 8), 2, 3),
    },
    (8192, 4096): {
        1: ((16, 64, 256, 4), 2, 3),
        16: ((16, 32, 256, 2), 1, 3),
        32: ((32, 64, 128, 4), 1, 3),
        64: ((64, 64, 64, 4), 1, 4),
        128: ((128, 128, 64, 8), 2, 4),
        256: ((128, 128, 64, 8), 1, 4),
    },
    (4096, 8192): {
        1: ((16, 32, 256, 2), 4, 3),
        16: ((16, 32, 256, 2), 4, 3),
        32: ((32, 64, 64, 4), 4, 4),
        64: ((64, 64, 64, 4), 4, 4),
        128: ((128, 128, 64, 8), 2, 4),
        256: ((128, 128, 64, 8), 1, 4),
    },
    (4096, 4096): {
        1: ((16, 32, 256, 2), 4, 3),
        16: ((16, 32, 256, 2), 4, 3),
        32: ((32, 64, 64, 4), 4, 4),
        64: ((64, 64, 128, 4), 2, 3),
        128: ((128, 64, 64, 8), 2, 4),
        256: ((128, 128, 64, 8), 1, 3),
    },
    (4096, 2048): {
        1: ((16, 32, 256, 4), 4, 3),
        16: ((16, 32, 256, 4), 1, 3),
        32: ((32, 128, 64, 8), 1, 4),
        64: ((64, 64, 128, 4), 4, 3),
        128: ((128, 64, 64, 8), 2, 3),
        256: ((128, 128, 64, 8), 1, 3),
    },
}

GENERIC: dict[int, Tiling] = {
    1: ((16, 64, 256, 4), 2, 4),
    16: ((16, 64, 256, 4), 2, 4),
    32: ((32, 64, 64, 4), 4, 4),
    64: ((64, 64, 64, 4), 2, 4),
    128: ((128, 64, 64, 8), 2, 3),
    256: ((128, 64, 64, 4), 1, 3),
}
# --- end of the table ---


def tiling(rows: int, n: int, k: int) -> dict:
    """`gemm.batched_matmul`'s tiling keywords for an FP8 weight [n, k] at `rows` rows in the default mode."""
    table = MEASURED.get((n, k), GENERIC)
    tiles, waves, stages = table[min(m for m in table if m >= rows)] if rows <= max(table) else PREFILL
    return {"tiles": tiles, "waves": waves, "stages": stages}
