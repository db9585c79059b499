"""The examples run as written."""

import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parent.parent / "examples"
# one intra-op thread for the demo model, as tests/conftest.py's run_cli (a second one on a shared 2-core machine
# made the offline example 2-3x slower)
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def run_example(name: str, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(EXAMPLES / name), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=ENV)


def test_select_backend_example_runs_on_cpu():
    result = run_example("select_backend.py", "--accelerator", "cpu")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("backend cpu on cpu: rms_norm + linear -> (4, 100)")


def test_select_backend_example_reports_an_unavailable_backend():
    result = run_example("select_backend.py", "--accelerator", "ascend")
    assert result.returncode == 2 and "torch_npu is not installed" in result.stderr
    assert "Traceback" not in result.stderr


def test_offline_inference_example_runs_on_the_demo_model():
    result = run_example("offline_inference.py", "--accelerator", "cpu")
    assert result.returncode == 0, result.stderr
    assert "RANDOM weights" in result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("'The capital of France is' -> ")
    assert "16 tokens, finish reason length" in lines[1]  # greedy, no EOS in 16 tokens of the demo model
    assert "top logprobs of the first token" in result.stdout
