"""Ranks on two "nodes" of this host (deepinfer_core/parallel/nodes.py): the head (an LLM here, rank 0) serves the
ranks' queues over TCP and a `deepinfer serve --headless` process (rank 1) joins them, as a second node would.
Seeded outputs equal the one-rank engine's; stopping the head ends the headless node."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer_core.engine.request import FailedRequest
from deepinfer_core.errors import DeepInferError
from deepinfer_core.parallel.nodes import restarted_ranks

PROMPTS = [[5 + i, 17, 33 + 2 * i, 9, 60 - i] for i in range(4)]
LONG = 48  # new tokens a request of the kill tests


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


def seeded(i: int, max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True)


def generate(llm, max_tokens: int = 8) -> list[tuple[int, ...]]:
    params = [seeded(i, max_tokens) for i in range(len(PROMPTS))]
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def start_headless(log: Path, port: int, flags: list[str]) -> subprocess.Popen:
    """`deepinfer serve --headless FLAGS` joining a head at 127.0.0.1:port, its output in `log`; the shared
    secret set here too (for the head this process runs)."""
    exe = shutil.which("deepinfer", path=str(Path(sys.executable).parent))
    env = {**os.environ, "DEEPINFER_DATA_PARALLEL_KEY": "test-secret", "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as out:
        node = subprocess.Popen(
            [exe, "serve", "--headless", *flags, "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port",
             str(port)], stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    os.environ["DEEPINFER_DATA_PARALLEL_KEY"] = "test-secret"
    return node


def test_a_headless_node_joins_the_heads_world(tiny_checkpoint, tmp_path):
    expected = generate(LLM(tiny_checkpoint, accelerator="rowwise_cpu", num_kv_blocks=64, progress=False))
    port = free_port_pair()
    log = tmp_path / "headless.log"
    flags = ["--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-start-rank", "1"]
    node = start_headless(log, port, flags)
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


@contextlib.contextmanager
def two_node_world(model, tmp_path: Path):
    """(the one-rank engine's tokens for the kill tests, the head: rank 0 of 3 here, the node's log, a headless node
    holding ranks 1-2); on leaving, the head and the node stopped and the shared secret unset. LONG tokens: the
    ranks, which run ahead of what the front has read, are still at it at the kill."""
    expected = generate(LLM(model, accelerator="rowwise_cpu", num_kv_blocks=64, progress=False), LONG)
    port = free_port_pair()
    log = tmp_path / "headless.log"
    node = start_headless(log, port, ["-dp", "3", "-dpl", "2", "--data-parallel-start-rank", "1"])
    head = None
    try:
        head = three_rank_head(model, port)
        yield expected, head, log, node
    finally:
        del os.environ["DEEPINFER_DATA_PARALLEL_KEY"]
        if head is not None:
            head.engine.shutdown()
        if node.poll() is None:
            node.kill()


def three_rank_head(model, port: int) -> LLM:
    """The head of a world of 3: rank 0 here, ranks 1-2 on the headless node joining at port."""
    return LLM(model, accelerator="rowwise_cpu", num_kv_blocks=64, progress=False, max_num_seqs=2,
               data_parallel_size=3, data_parallel_size_local=1, enable_expert_parallel=True,
               data_parallel_rpc_port=port)  # fmt: skip


def stream_and_lose(engine, lose) -> list[tuple[int, ...]]:
    """PROMPTS added (seeded, LONG new tokens) and streamed to the end, `lose()` called once mid-run (some tokens
    out, most not); each request's tokens as streamed. A request that fails fails the test."""
    streamed = {str(i): [] for i in range(len(PROMPTS))}
    for i, prompt in enumerate(PROMPTS):  # seeded as generate() seeds them
        engine.add_request(str(i), prompt, seeded(i, LONG))
    lost = False
    while engine.has_unfinished():
        for output in engine.step():
            assert not isinstance(output, FailedRequest), output.error
            streamed[output.request_id].extend(output.outputs[0].new_token_ids)
        if not lost and sum(map(len, streamed.values())) >= 6:
            lose()
            lost = True
    assert lost, "every request ended before the loss"
    return [tuple(streamed[str(i)]) for i in range(len(PROMPTS))]


def test_restarted_ranks_keep_their_devices_in_the_new_order():
    # a node ran old ranks 1 and 2 on its devices 0 and 1; rank 1 was lost: old rank 2 is rank 1 now, on device 1
    assert restarted_ranks({1: 0, 2: 1}, [0, 2]) == {1: 1}
    assert restarted_ranks({1: 0, 2: 1}, [0, 1, 2]) == {1: 0, 2: 1}  # an error of a rank's own: every rank stays
    assert restarted_ranks({3: 0}, [0, 1, 2]) == {}  # this node's only rank was lost


def test_a_rank_killed_on_another_node_restarts_the_instance_across_nodes(tiny_checkpoint, tmp_path):
    """Head: rank 0 (an LLM here); a headless node: ranks 1 and 2. kill -9 of rank 1 mid-run: the node reports
    it, the head restarts a world of 2 (old rank 2 is rank 1 now, on the node's device it had), every request
    completes with an undisturbed run's tokens as streamed, and the node goes on until the head stops it."""
    import signal

    with two_node_world(tiny_checkpoint, tmp_path) as (expected, head, log, node):
        engine = head.engine
        victim = engine.rank_info[1]["pid"]
        streamed = stream_and_lose(engine, lambda: os.kill(victim, signal.SIGKILL))
        assert len(engine.restarts) == 1, engine.restarts
        restart = engine.restarts[0]
        assert restart["lost"] == [1] and restart["world_size"] == 2, restart
        assert "without a word" in restart["reason"], restart
        assert streamed == expected
        assert engine.rank_info[1]["pid"] != victim and node.poll() is None, log.read_text()
        assert generate(head, LONG) == expected  # the restarted world serves new requests too
        engine.shutdown()
        assert node.wait(timeout=60) == 0, log.read_text()
        assert "ranks [1] of 2 on devices [1]" in log.read_text()


@pytest.mark.parametrize("how", ["sigterm", "vanished"])
def test_a_node_lost_whole_restarts_the_instance_on_the_others(tiny_checkpoint, tmp_path, how):
    """The headless node (ranks 1 and 2) goes mid-run: stopped by SIGTERM (it reports its ranks as ended, then
    stops them), or vanished (its supervisor and its ranks killed, as when its machine goes down: nobody reports,
    the head's census of the nodes gets no answer). The head restarts alone (world size 1) and every request
    completes with an undisturbed run's tokens."""
    import signal

    with two_node_world(tiny_checkpoint, tmp_path) as (expected, head, log, node):
        engine = head.engine
        ranks = [engine.rank_info[r]["pid"] for r in (1, 2)]

        def vanish() -> None:
            node.kill()
            for pid in ranks:
                os.kill(pid, signal.SIGKILL)

        streamed = stream_and_lose(engine, node.terminate if how == "sigterm" else vanish)
        assert len(engine.restarts) == 1, engine.restarts
        restart = engine.restarts[0]
        assert restart["lost"] == [1, 2] and restart["world_size"] == 1, restart
        assert streamed == expected
        assert node.wait(timeout=30) != 0
