"""Every nvidia_sm100 kernel, as its launchers call it, compiles for SM90 without a GPU (see compile_sm90.py):
the Triton interpreter of the other kernel tests runs Python semantics and accepts code the compiler refuses.
DeepSeek-V4's kernels and constexpr specialisations (swiglu limit, sqrtsoftplus, hash routing) are compiled too,
and V4.1's (hc_mixes' pre, hc_expand's float32 sum, the three block formats, the engram gate)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (tox installs it for the kernel tests)")


@pytest.mark.long  # minutes where Triton's cache is cold (a fresh CI machine)
def test_all_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_sm90.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    kernels = {line.split()[0] for line in done.stdout.splitlines() if line}
    expected = {
        *("_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel", "_matmul_kernel", "_split_sum_kernel"),
        *("_gate_up_kernel", "_down_kernel", "_paged_attention_kernel", "_route_kernel", "_gumbel_kernel"),
        *("_hc_mix_kernel", "_hc_post_kernel", "_softmax_pool_kernel", "_hc_norm_kernel", "_hc_collapse_kernel"),
        *("_round_kernel", "_pack_kernel", "_engram_gate_kernel", "_unpack_rows_kernel"),
        *("_sparse_attention_kernel", "_sparse_attention_split_kernel", "_merge_splits_kernel"),
        "_index_scores_kernel",
        "_block_attention_kernel",
        "_bitmask_kernel",  # structured outputs' token mask
    }
    assert kernels == expected, f"compiled {sorted(kernels)}"
    # DeepSeek-V4's specialisations: the swiglu limit in both activations, sqrtsoftplus scores, hash routing,
    # both hyper-connection mixer forms; V4.1's pre in place of the collapse, its float32 expansion, its block formats
    variants = done.stdout.splitlines()
    for kernel, flag in (
        ("_silu_and_mul_kernel", "('HAS_LIMIT', True)"),
        ("_gate_up_kernel", "('HAS_LIMIT', True)"),
        ("_route_kernel", "('SCORING', 2)"),
        ("_route_kernel", "('HASH', True)"),
        ("_hc_mix_kernel", "('HAS_COMB', True)"),
        ("_hc_mix_kernel", "('HAS_COMB', False)"),
        ("_sparse_attention_kernel", "('INDEXED', True)"),
        ("_sparse_attention_split_kernel", "('INDEXED', True)"),
        ("_hc_mix_kernel", "('COLLAPSE', False)"),
        ("_hc_post_kernel", "('ROUND_TERMS', False)"),
        *(("_round_kernel", f"('FORMAT', {fmt})") for fmt in range(3)),
        *(("_pack_kernel", f"('FORMAT', {fmt})") for fmt in range(3)),
        # V4.1's packed caches: staged (the FP8 ring by the GPU's cvt) and decoded in the kernels
        *(("_unpack_rows_kernel", f"('FMT', {fmt})") for fmt in (2, 3, 4)),
        ("_sparse_attention_kernel", "('COMP_FMT', 3)"),
        ("_sparse_attention_split_kernel", "('COMP_FMT', 3)"),
        ("_index_scores_kernel", "('KEY_FMT', 2)"),
        # DeepSeek's released weight formats in both GEMMs: E8M0 FP8 (V4's 128 and V4.1's 32 blocks), FP4 experts
        ("_matmul_kernel", "('FORMAT', 2)"),
        ("_matmul_kernel", "('QBK', 32)"),
        ("_gate_up_kernel", "('FORMAT', 3)"),
        ("_down_kernel", "('FORMAT', 3)"),
        ("_gate_up_kernel", "('FORMAT', 2)"),
    ):
        assert any(v.startswith(kernel + " ") and flag in v for v in variants), f"{kernel} with {flag} not compiled"
