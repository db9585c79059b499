"""`deepinfer serve --data-parallel-size 2 --enable-expert-parallel`: one API server, two engine rank processes
splitting the demo model's routed experts (rowwise_cpu over gloo). Official clients against the live server:
greedy outputs equal the one-rank engine's, a concurrent load completes, structured outputs hold, /metrics
shows the moe_lb ratio, a rank killed with SIGKILL mid-load loses no request, and SIGTERM lets the requests in
flight finish, then stops every rank."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import openai
import pytest

MODEL = "deepinfer-demo-deepseek-v4-random"
RANKS = ("--accelerator", "rowwise_cpu", "--data-parallel-size", "2", "--enable-expert-parallel")
PROMPTS = [[5 + i, 17, 33 + 2 * i, 9, 60 - i] for i in range(6)]


@pytest.fixture(scope="module")
def ranks_server(start_server):
    return start_server(*RANKS, "--num-kv-blocks", "64", "--max-num-seqs", "8", "--seed", "0")


def client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def rank_pids(server) -> list[int]:
    """The server's engine rank processes (spawned children running multiprocessing's spawn entry point)."""
    children = subprocess.run(["pgrep", "-P", str(server.process.pid)], capture_output=True, text=True).stdout
    pids = []
    for pid in map(int, children.split()):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmdline:
            pids.append(pid)
    return pids


async def complete_all(server, max_tokens: int, count: int) -> list:
    async with client(server) as api:
        return await asyncio.gather(*[
            api.completions.create(model=MODEL, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens,
                                   temperature=0, extra_body={"ignore_eos": True})
            for i in range(count)
        ])  # fmt: skip


def test_greedy_outputs_equal_the_one_rank_engine(ranks_server):
    from deepinfer import LLM, SamplingParams

    served = asyncio.run(complete_all(ranks_server, 8, len(PROMPTS)))
    one = LLM(accelerator="rowwise_cpu", num_kv_blocks=64, progress=False)
    expected = one.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [r.choices[0].text for r in served] == [o.outputs[0].text for o in expected]
    assert len({o.outputs[0].token_ids for o in expected}) > 1


def test_a_concurrent_load_completes_and_the_metrics_show_both_ranks(ranks_server):
    async def streams():
        async with client(ranks_server) as api:

            async def one(i: int) -> tuple[int, str | None]:
                stream = await api.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"story {i}"}], max_tokens=6, stream=True,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                pieces, finish = 0, None
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        pieces += 1
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                return pieces, finish

            return await asyncio.gather(*[one(i) for i in range(24)])

    results = asyncio.run(streams())
    assert all(finish == "length" and pieces >= 1 for pieces, finish in results), results
    samples = ranks_server.metrics()
    lb = [v for k, v in samples.items() if k.startswith("deepinfer:moe_lb_ratio{") and 'layer="all"' in k]
    assert lb and 1.0 <= lb[0] <= 2.0, lb  # two ranks: at most all rows on one (2x the mean)
    assert ranks_server.wait_idle() == (0, 0, 0)


def test_a_request_a_rank_refuses_fails_alone(ranks_server):
    """A prompt token outside the vocabulary passes the server's checks and is refused by the rank that gets it:
    that request is a 400 naming the problem, while requests running beside it complete."""

    async def mixed():
        async with client(ranks_server) as api:
            good = [api.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=16, temperature=0,
                                           extra_body={"ignore_eos": True}) for i in range(4)]  # fmt: skip
            bad = api.completions.create(model=MODEL, prompt=[5, 10**6], max_tokens=4)
            return await asyncio.gather(*good, bad, return_exceptions=True)

    *good, bad = asyncio.run(mixed())
    assert all(r.choices[0].finish_reason == "length" for r in good), good
    assert isinstance(bad, openai.BadRequestError) and "prompt token id 1000000 is outside" in str(bad), bad


def test_structured_outputs_hold_across_ranks(ranks_server):
    async def ask():
        async with client(ranks_server) as api:
            return await api.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "json please"}], max_tokens=40,
                response_format={"type": "json_object"},
            )  # fmt: skip

    reply = asyncio.run(ask())
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:  # cut at max_tokens: a prefix of an object
        assert reply.choices[0].message.content.startswith("{")


def test_a_rank_killed_mid_load_loses_no_request_and_sigterm_drains_then_stops_every_rank(start_server):
    server = start_server(*RANKS, "--num-kv-blocks", "64", "--max-num-seqs", "4")
    started = time.monotonic()
    expected = [r.choices[0].text for r in asyncio.run(complete_all(server, 24, 8))]
    undisturbed = time.monotonic() - started
    pids = rank_pids(server)
    assert len(pids) == 2, pids

    async def load_with_a_kill():
        task = asyncio.ensure_future(complete_all(server, 24, 8))
        await asyncio.sleep(undisturbed / 3)  # the requests are running
        assert not task.done()
        os.kill(pids[1], signal.SIGKILL)
        return await task

    got = [r.choices[0].text for r in asyncio.run(load_with_a_kill())]
    assert got == expected
    log = server.log()
    assert "engine restarted with 1 rank(s)" in log and "re-queued" in log, log[-3000:]
    survivors = rank_pids(server)
    assert len(survivors) == 1 and survivors[0] not in pids, (pids, survivors)

    async def drained_by_sigterm():  # requests in flight when SIGTERM comes finish (the grace period)
        task = asyncio.ensure_future(complete_all(server, 24, 4))
        await asyncio.sleep(undisturbed / 4)
        server.begin_stop()
        return await task

    drained = asyncio.run(drained_by_sigterm())
    assert [r.choices[0].finish_reason for r in drained] == ["length"] * 4
    server.wait_stopped()
    assert server.process.returncode == 0, server.log()[-3000:]
    time.sleep(0.5)
    assert not any(Path(f"/proc/{pid}").exists() for pid in survivors), "a rank outlived the server"
