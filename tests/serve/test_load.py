"""Load on a live server: hundreds of concurrent streams, clients that go away mid-request, and backpressure
(503 + Retry-After) when more requests arrive than the server lets wait. After each, the KV cache and the
running/waiting gauges of /metrics return to zero."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

MODEL = "deepinfer-demo-deepseek-v4-random"
GENERATED = "vllm:generation_tokens_total"
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
COMPLETIONS = "/v1/completions"
MESSAGES = "/v1/messages"


def body(path: str, max_tokens: int, stream: bool, **extra) -> dict:
    if path == COMPLETIONS:
        base = {"prompt": "Once upon a time", "max_tokens": max_tokens}
    elif path == RESPONSES:
        base = {"input": "Once upon a time", "max_output_tokens": max_tokens}
    else:
        base = {"messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": max_tokens}
    return {"model": MODEL, "stream": stream, **base, **extra}


# ---- concurrency --------------------------------------------------------------------------------------------

NUM_CONCURRENT = 200


def test_200_concurrent_streams_complete_and_free_everything(server):
    assert server.wait_idle() == (0, 0, 0)
    before = server.metrics()

    async def run():
        limits = httpx.Limits(max_connections=NUM_CONCURRENT + 10, max_keepalive_connections=NUM_CONCURRENT + 10)
        client = openai.AsyncOpenAI(
            base_url=server.url + "/v1",
            api_key="unused",
            max_retries=0,
            default_headers={"Connection": "close"},
            timeout=120,
            http_client=openai.DefaultAsyncHttpxClient(limits=limits),
        )
        peaks = {"running": 0.0, "kv": 0.0}
        done = asyncio.Event()

        async def watch():  # sample the gauges while the burst runs
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as raw:
                while not done.is_set():
                    text = (await raw.get("/metrics")).text
                    for line in text.splitlines():
                        if line.startswith("vllm:num_requests_running{"):
                            peaks["running"] = max(peaks["running"], float(line.split()[1]))
                        elif line.startswith("deepinfer_kv_blocks_used "):
                            peaks["kv"] = max(peaks["kv"], float(line.split()[1]))
                    await asyncio.sleep(0.05)

        async def one(i: int):
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"request number {i}"}],
                max_tokens=4,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            finish, usage, pieces = None, None, 0
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if chunk.usage is not None:
                    usage = chunk.usage
                pieces += 1
            return finish, usage, pieces

        watcher = asyncio.create_task(watch())
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(NUM_CONCURRENT))), 240), peaks
        finally:
            done.set()
            await watcher
            await client.close()

    results, peaks = asyncio.run(run())
    assert len(results) == NUM_CONCURRENT
    for finish, usage, pieces in results:
        assert finish in ("length", "stop") and usage is not None and pieces >= 2
        assert usage.completion_tokens <= 4 and usage.prompt_tokens > 0
    # (a reply may count fewer tokens than it generated: the protocol layer drops the bytes of a character
    # that the last token left incomplete, and its count with them)
    assert sum(usage.completion_tokens == 4 for _, usage, _ in results) >= 0.9 * NUM_CONCURRENT
    assert 1 < peaks["running"] <= 64  # batched together, within --max-num-seqs
    assert peaks["kv"] > 1
    after = server.metrics()
    ok = 'deepinfer_requests_total{endpoint="chat_completions",status="200"}'
    assert after[ok] - before.get(ok, 0) == NUM_CONCURRENT
    generated = server.value(GENERATED, after) - server.value(GENERATED, before)
    lengths = sum(finish == "length" for finish, _, _ in results)
    assert 4 * lengths <= generated <= 4 * NUM_CONCURRENT
    assert server.wait_idle() == (0, 0, 0)  # every KV block back, nothing running or waiting


# ---- client disconnects -------------------------------------------------------------------------------------

LONG = 1500  # tokens: far more than a test waits for (ignore_eos: a sampled EOS would end it early)


def assert_aborted(server, generated_before: float) -> None:
    assert server.wait_idle(timeout=15) == (0, 0, 0), "the abandoned request still holds the engine"
    generated = server.value(GENERATED)
    time.sleep(0.3)
    assert server.value(GENERATED) == generated, "tokens are still being generated"
    assert generated - generated_before < LONG


@pytest.mark.parametrize("path", [CHAT, RESPONSES, COMPLETIONS, MESSAGES])
def test_disconnect_mid_stream_aborts_and_frees_blocks(server, path):
    assert server.wait_idle() == (0, 0, 0)
    generated_before = server.value(GENERATED)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", path, json=body(path, LONG, True, temperature=1.0, ignore_eos=True)) as r:
            assert r.status_code == 200
            lines, events = r.iter_lines(), 0  # (closing this iterator would close the connection already)
            while events < 4:
                events += next(lines).startswith("data:")
            kv, running, _ = server.gauges()
            assert running == 1 and kv > 0  # it is in flight...
        # ...and leaving the block closes the connection mid-stream
    assert_aborted(server, generated_before)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, MESSAGES])
def test_disconnect_while_waiting_for_a_whole_response_aborts(server, path):
    assert server.wait_idle() == (0, 0, 0)
    generated_before = server.value(GENERATED)
    with httpx.Client(base_url=server.url, timeout=1.5) as client, pytest.raises(httpx.ReadTimeout):
        client.post(path, json=body(path, LONG, False, temperature=1.0, ignore_eos=True))
    assert_aborted(server, generated_before)


def test_server_serves_after_disconnects(server, openai_client):
    r = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0
    )
    assert r.usage.completion_tokens == 3
    assert server.server_errors() == {}


# ---- backpressure -------------------------------------------------------------------------------------------

BURST = 8


def overload_type(path: str) -> str:
    return "overloaded_error" if path == MESSAGES else "server_overloaded"


@pytest.mark.parametrize("path", [CHAT, RESPONSES, COMPLETIONS, MESSAGES])
def test_burst_beyond_the_waiting_limit_gets_503_with_retry_after(busy_server, path):
    """--max-num-seqs 1 --max-waiting-requests 1: two requests in flight at most, the rest are refused."""
    assert busy_server.wait_idle() == (0, 0, 0)

    async def one(client: httpx.AsyncClient, i: int):
        stream = i % 2 == 1
        payload = body(path, 24, stream, temperature=0)
        async with client.stream("POST", path, json=payload) as r:
            raw = await r.aread()
            return r.status_code, r.headers, raw, stream

    async def burst():
        async with httpx.AsyncClient(base_url=busy_server.url, timeout=60) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(BURST))), 120)

    results = asyncio.run(burst())  # a hang would raise TimeoutError here
    statuses = [status for status, *_ in results]
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(503) >= 1 and statuses.count(200) >= 2, statuses
    for status, headers, raw, stream in results:
        if status == 503:
            assert headers["retry-after"].isdigit() and int(headers["retry-after"]) >= 1
            error = json.loads(raw)
            if path == MESSAGES:
                assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"
            else:
                assert error["error"]["type"] == overload_type(path) and error["error"]["message"]
        elif stream:
            last_event = {CHAT: "data: [DONE]", COMPLETIONS: "data: [DONE]", MESSAGES: "event: message_stop"}
            assert last_event.get(path, "event: response.incomplete") in raw.decode()
        else:
            answer = json.loads(raw)
            usage = answer["usage"]
            assert usage.get("completion_tokens", usage.get("output_tokens")) == 24
    assert busy_server.wait_idle() == (0, 0, 0)


def test_503_through_the_openai_client_and_recovery(busy_server):
    client = openai.AsyncOpenAI(
        base_url=busy_server.url + "/v1",
        api_key="unused",
        max_retries=0,
        default_headers={"Connection": "close"},
        timeout=60,
    )

    async def one():
        try:
            r = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=16, temperature=0
            )
            return r.usage.completion_tokens
        except openai.APIStatusError as err:
            return err

    async def burst():
        try:
            return await asyncio.wait_for(asyncio.gather(*(one() for _ in range(BURST))), 120)
        finally:
            await client.close()

    results = asyncio.run(burst())
    refused = [r for r in results if isinstance(r, openai.APIStatusError)]
    assert refused and all(e.status_code == 503 and e.response.headers["retry-after"] for e in refused)
    assert all(r == 16 for r in results if not isinstance(r, openai.APIStatusError))
    assert busy_server.wait_idle() == (0, 0, 0)
    # after Retry-After, the refused requests go through
    time.sleep(1)
    retry = openai.OpenAI(
        base_url=busy_server.url + "/v1",
        api_key="unused",
        max_retries=0,
        default_headers={"Connection": "close"},
        timeout=60,
    )
    for _ in refused[:2]:
        r = retry.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
        )
        assert r.usage.completion_tokens == 2


def test_request_larger_than_the_kv_cache_is_400(busy_server):
    """4 KV blocks of 128 tokens: a request that may need more is refused up front, not left waiting."""
    with httpx.Client(base_url=busy_server.url, timeout=30) as client:
        r = client.post(CHAT, json=body(CHAT, 1000, False, temperature=0))
        assert r.status_code == 400 and "KV cache" in r.json()["error"]["message"], r.text
        r = client.post(MESSAGES, json=body(MESSAGES, 1000, True, temperature=0))
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert busy_server.wait_idle() == (0, 0, 0)
    assert busy_server.server_errors() == {}
    busy_server.assert_no_tracebacks()
