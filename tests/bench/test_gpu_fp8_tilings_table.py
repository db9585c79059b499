"""bench/gpu_fp8_tilings.py --table: kernels/fp8_tilings' literals read off sweep results. A later sweep's entry
replaces an earlier one only where it beat production in its own run; GENERIC takes the tiling fastest over the
shapes among those every shape was timed in. The table printed is Python the module can hold."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (tox installs it for the kernel tests)")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_fp8_tilings.py"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec = importlib.util.spec_from_file_location("gpu_fp8_tilings_under_test", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(SCRIPT.parent))


A, B, C = "bm16_bn64_bk128_w4_waves1_s4", "bm16_bn32_bk256_w2_waves2_s3", "bm64_bn64_bk64_w4_waves2_s4"


def row(n: int, k: int, m: int, production_ms: float, **tilings_ms: float) -> dict:
    best = min(tilings_ms, key=tilings_ms.get)
    return {"n": n, "k": k, "m": m, "production_ms": production_ms, "tilings_ms": tilings_ms, "best": best,
            "best_ms": tilings_ms[best]}  # fmt: skip


def literals(text: str) -> dict:
    """MEASURED and GENERIC as the module would hold them."""
    body = text.split("\n", 1)[1].rsplit("\n", 1)[0]  # between the two marker comments
    tree = ast.parse(body)
    return {node.target.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.AnnAssign)}


def test_a_later_sweep_replaces_only_the_entries_it_beat_production_on(bench):
    earlier = {"rows": [row(512, 4096, 1, 9.0, **{A: 5.0}), row(4096, 2048, 1, 9.0, **{A: 8.0})]}
    later = {"rows": [row(512, 4096, 1, 5.1, **{A: 5.1, B: 4.0}),  # beat production (the earlier pick): replaces
                      row(4096, 2048, 1, 7.9, **{A: 8.1, B: 7.95})]}  # best slower than production: kept  # fmt: skip
    text = bench.table([earlier, later])
    assert text.startswith(bench.TABLE_START) and text.endswith(bench.TABLE_END)
    measured = literals(text)["MEASURED"]
    assert measured[(512, 4096)][1] == bench.spec_of(B)
    assert measured[(4096, 2048)][1] == bench.spec_of(A)


def test_a_later_sweep_that_only_ties_production_leaves_the_entry(bench):
    earlier = {"rows": [row(512, 4096, 16, 9.0, **{A: 5.0})]}
    later = {"rows": [row(512, 4096, 16, 4.95, **{A: 5.0, B: 4.99})]}  # B, its best, within noise of production's
    assert literals(bench.table([earlier, later]))["MEASURED"][(512, 4096)][16] == bench.spec_of(A)


def test_generic_is_fastest_over_every_shape_among_tilings_timed_on_all(bench):
    result = {"rows": [row(512, 4096, 64, 9.0, **{A: 3.0, C: 2.0}), row(4096, 2048, 64, 9.0, **{A: 3.0, C: 5.0}),
                       row(1024, 4096, 64, 9.0, **{A: 3.0, C: 2.5, B: 0.1})]}  # B: timed on one shape only  # fmt: skip
    tables = literals(bench.table([result]))
    assert tables["GENERIC"][64] == bench.spec_of(A)  # 9.0 over the three against C's 9.5; B not on every shape
    assert tables["MEASURED"][(1024, 4096)][64] == bench.spec_of(B)  # a shape's own pick may be any it was timed in
