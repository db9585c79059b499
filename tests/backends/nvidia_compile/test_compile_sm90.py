"""Every nvidia_sm100 kernel, as its launchers call it, compiles for SM90 without a GPU (see compile_sm90.py):
the Triton interpreter of the other kernel tests runs Python semantics and accepts code the compiler refuses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (tox installs it for the kernel tests)")


def test_all_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_sm90.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    kernels = {line.split()[0] for line in done.stdout.splitlines() if line}
    expected = {
        *("_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel", "_matmul_kernel", "_split_sum_kernel"),
        *("_gate_up_kernel", "_down_kernel", "_paged_attention_kernel", "_route_kernel", "_gumbel_kernel"),
    }
    assert kernels == expected, f"compiled {sorted(kernels)}"
