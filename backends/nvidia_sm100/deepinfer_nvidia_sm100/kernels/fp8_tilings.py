"""The default mode's tilings of FP8 projections (ops.BlockFP8 weights in `gemm.matmul`), per weight shape and row
count, as vLLM keeps tuned configs per (N, K) and batch size for its block-FP8 kernels.

MEASURED: V4 Flash's seven dense projection shapes, each tiling the fastest of a grid on the H200
(bench/gpu_fp8_tilings.py; bench/results/gpu_fp8_tilings_nvidia_h200.json; regenerate the literal with
`python bench/gpu_fp8_tilings.py --table RESULT`). A row count uses the entry of the smallest measured count at or
above it; "large" is production's 128 x 128 tiling. Other shapes take GENERIC: per row count the one tiling
fastest over the seven shapes together. Past LARGE_ROWS rows every shape takes the large tiling.

The tiling follows the rows, so results are not batch-invariant (the batch-invariant mode keeps one fixed
tiling); each tiling is deterministic (its K splits depend on the shape only).
"""

from __future__ import annotations

Tiling = tuple[tuple[int, int, int, int], int, int] | str  # ((BM, BN, BK, warps), waves, stages) or "large"

LARGE: Tiling = ((128, 128, 64, 8), 1, 3)
LARGE_ROWS = 128  # from here on (compute-bound) the large tiling

MEASURED: dict[tuple[int, int], dict[int, Tiling]] = {
    (1024, 4096): {
        1: ((16, 64, 128, 4), 1, 4),
        16: ((16, 64, 128, 4), 1, 4),
        32: ((32, 64, 128, 4), 4, 4),
        64: ((64, 64, 128, 4), 2, 4),
        128: ((64, 64, 128, 4), 2, 4),
    },
    (32768, 1024): {
        1: ((16, 64, 128, 4), 1, 4),
        16: ((16, 64, 128, 4), 1, 4),
        32: ((32, 64, 64, 4), 1, 4),
        64: ((64, 64, 64, 4), 1, 4),
        128: ((64, 64, 64, 4), 1, 4),
    },
    (512, 4096): {
        1: ((16, 64, 128, 4), 2, 4),
        16: ((16, 64, 128, 4), 4, 4),
        32: ((32, 64, 64, 4), 2, 4),
        64: ((64, 64, 64, 4), 2, 4),
        128: ((64, 64, 128, 4), 2, 4),
    },
    (8192, 4096): {
        1: ((16, 64, 256, 4), 2, 4),
        16: ((16, 64, 256, 4), 2, 4),
        32: ((32, 64, 64, 4), 1, 4),
        64: ((64, 64, 64, 4), 1, 4),
        128: "large",
    },
    (4096, 8192): {
        1: ((16, 64, 256, 4), 2, 4),
        16: ((16, 64, 256, 4), 2, 4),
        32: ((32, 64, 64, 4), 4, 4),
        64: ((64, 64, 64, 4), 4, 4),
        128: "large",
    },
    (4096, 4096): {
        1: ((16, 64, 256, 4), 2, 4),
        16: ((16, 64, 256, 4), 4, 4),
        32: ((32, 64, 64, 4), 4, 4),
        64: ((64, 64, 64, 4), 4, 4),
        128: "large",
    },
    (4096, 2048): {
        1: ((16, 64, 128, 4), 4, 4),
        16: ((16, 64, 256, 4), 2, 4),
        32: ((32, 64, 64, 4), 4, 4),
        64: ((64, 64, 128, 4), 4, 4),
        128: "large",
    },
}

GENERIC: dict[int, Tiling] = {
    1: ((16, 64, 256, 4), 2, 4),
    16: ((16, 64, 256, 4), 2, 4),
    32: ((32, 64, 64, 4), 4, 4),
    64: ((64, 64, 64, 4), 4, 4),
    128: "large",
}


def tiling(rows: int, n: int, k: int) -> dict:
    """`gemm.batched_matmul`'s tiling keywords for an FP8 weight [n, k] at `rows` rows in the default mode."""
    if rows > LARGE_ROWS:
        spec = LARGE
    else:
        table = MEASURED.get((n, k), GENERIC)
        spec = table[min(m for m in table if m >= rows)]
    tiles, waves, stages = LARGE if spec == "large" else spec
    return {"tiles": tiles, "waves": waves, "stages": stages}
