"""Ranks on two "nodes" of this host (deepinfer_core/parallel/nodes.py): the head (an LLM here, rank 0) serves the
ranks' queues over TCP and a `deepinfer serve --headless` process (rank 1) joins them, as a second node would.
Seeded outputs equal the one-rank engine's; stopping the head ends the headless node."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer_core.errors import DeepInferError

PROMPTS = [[5 + i, 17, 33 + 2 * i, 9, 60 - i] for i in range(4)]


def free_port_pair() -> int:
    """A port p with p + 1 free too."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no two consecutive free ports")


def generate(llm) -> list[tuple[int, ...]]:
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=i, ignore_eos=True) for i in range(len(PROMPTS))]
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_a_headless_node_joins_the_heads_world(tiny_checkpoint, tmp_path):
    expected = generate(LLM(tiny_checkpoint, accelerator="rowwise_cpu", num_kv_blocks=64, progress=False))
    port = free_port_pair()
    exe = shutil.which("deepinfer", path=str(Path(sys.executable).parent))
    env = {**os.environ, "DEEPINFER_DATA_PARALLEL_KEY": "test-secret", "OMP_NUM_THREADS": "1"}
    log = tmp_path / "headless.log"
    with open(log, "wb") as out:
        node = subprocess.Popen(
            [exe, "serve", "--headless", "--data-parallel-size", "2", "--data-parallel-size-local", "1",
             "--data-parallel-start-rank", "1", "--data-parallel-address", "127.0.0.1",
             "--data-parallel-rpc-port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    os.environ["DEEPINFER_DATA_PARALLEL_KEY"] = "test-secret"
    try:
        head = LLM(tiny_checkpoint, accelerator="rowwise_cpu", num_kv_blocks=64, progress=False,
                   data_parallel_size=2, data_parallel_size_local=1, enable_expert_parallel=True,
                   data_parallel_rpc_port=port)  # fmt: skip
        assert generate(head) == expected
        head.engine.shutdown()
        assert node.wait(timeout=60) == 0, log.read_text()
        assert "joining the head at 127.0.0.1" in log.read_text()
    finally:
        del os.environ["DEEPINFER_DATA_PARALLEL_KEY"]
        if node.poll() is None:
            node.kill()


def test_node_flags_are_checked():
    with pytest.raises(DeepInferError, match="data_parallel_size_local must be 1 to 2"):
        LLM(accelerator="rowwise_cpu", data_parallel_size=2, data_parallel_size_local=3)
