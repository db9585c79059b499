"""/metrics under vLLM's names, types and labels (so vLLM dashboards work), with values that move as
requests run on every route, and the per-request log line."""

from __future__ import annotations

import re
import time

import httpx
import pytest

MODEL = "deepinfer-demo-deepseek-v4-random"
LABELS = f'engine="0",model_name="{MODEL}"'
VLLM = {  # name -> Prometheus type, as vLLM declares them
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
}


def labels_of(key: str) -> tuple[str, dict[str, str]]:
    """`name{a="b",...}` -> (name, {a: b, ...})."""
    name, _, rest = key.partition("{")
    return name, dict(re.findall(r'(\w+)="([^"]*)"', rest))


def value(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sample of `name` for this model and engine (and `labels`); 0 when absent."""
    wanted = {"model_name": MODEL, "engine": "0", **labels}
    found = [v for key, v in samples.items() if labels_of(key) == (name, {**labels_of(key)[1], **wanted})]
    return found[0] if found else 0.0


def success(samples: dict[str, float], reason: str) -> float:
    return value(samples, "vllm:request_success_total", finished_reason=reason)


def test_vllm_names_types_and_labels(server):
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name, kind in VLLM.items():
        declared = {f"# TYPE {name} {kind}", f"# TYPE {name}_total {kind}"}  # the client library's spellings
        assert any(line in text for line in declared), name
        sample = name + ("_total" if kind == "counter" else "_count" if kind == "histogram" else "")
        assert re.search(rf'^{re.escape(sample)}{{[^}}]*model_name="{MODEL}"[^}}]*}} ', text, re.M), sample
    samples = server.metrics()
    for reason in ("stop", "length", "abort"):
        assert any(
            labels_of(k)
            == ("vllm:request_success_total", {"model_name": MODEL, "engine": "0", "finished_reason": reason})
            for k in samples
        ), reason


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def finished(before: dict, after: dict, reason: str) -> float:
    return success(after, reason) - success(before, reason)


def test_a_completion_moves_the_counters(server, openai_client):
    server.wait_idle()
    before = server.metrics()
    r = openai_client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=3, seed=1, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    after = server.metrics()
    assert finished(before, after, "length") == 1
    assert finished(before, after, "stop") == 0
    assert delta(before, after, "vllm:prompt_tokens_total") == r.usage.prompt_tokens
    assert delta(before, after, "vllm:generation_tokens_total") == 3
    assert delta(before, after, "vllm:time_to_first_token_seconds_count") == 1
    assert delta(before, after, "vllm:inter_token_latency_seconds_count") == 2
    assert delta(before, after, "vllm:e2e_request_latency_seconds_count") == 1
    assert delta(before, after, "vllm:e2e_request_latency_seconds_sum") > 0
    assert delta(before, after, "vllm:request_params_max_tokens_sum") == 3
    assert delta(before, after, "vllm:request_prompt_tokens_sum") == r.usage.prompt_tokens


def test_n_samples_count_all_their_tokens(server, openai_client):
    server.wait_idle()
    before = server.metrics()
    r = openai_client.completions.create(
        model=MODEL, prompt="hello", n=3, max_tokens=2, seed=2, extra_body={"ignore_eos": True}
    )
    after = server.metrics()
    assert r.usage.completion_tokens == 6
    assert delta(before, after, "vllm:generation_tokens_total") == 6
    assert delta(before, after, "vllm:request_params_n_sum") == 3
    assert finished(before, after, "length") == 1


def test_every_route_is_counted(server, openai_client, anthropic_client):
    server.wait_idle()
    before = server.metrics()
    messages = [{"role": "user", "content": "hi"}]
    openai_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    openai_client.responses.create(model=MODEL, input="hi", max_output_tokens=2, temperature=0)
    anthropic_client.messages.create(model=MODEL, messages=messages, max_tokens=2)
    after = server.metrics()
    assert sum(finished(before, after, reason) for reason in ("stop", "length", "abort")) == 3
    assert delta(before, after, "vllm:e2e_request_latency_seconds_count") == 3


def test_a_stop_and_an_abort_are_told_apart(server, openai_client):
    server.wait_idle()
    first = openai_client.completions.create(
        model=MODEL, prompt="hello", max_tokens=4, seed=3, extra_body={"return_tokens_as_token_ids": True}, logprobs=0
    )
    token = int(first.choices[0].logprobs.tokens[0].removeprefix("token_id:"))
    before = server.metrics()
    stopped = openai_client.completions.create(
        model=MODEL, prompt="hello", max_tokens=4, seed=3, extra_body={"stop_token_ids": [token]}
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert finished(before, server.metrics(), "stop") == 1
    before = server.metrics()
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1500, "stream": True, "temperature": 1.0}
    with httpx.Client(base_url=server.url, timeout=60) as client, client.stream("POST", "/v1/completions", json=body):
        usage = server.value("vllm:kv_cache_usage_perc")
        running = server.value("vllm:num_requests_running")
    assert 0 < usage <= 1 and running == 1  # in flight, then the client leaves
    server.wait_idle(timeout=15)
    assert finished(before, server.metrics(), "abort") == 1


def test_prefix_cache_counters_move(server, openai_client):
    prompt = "The same long prompt, again and again. " * 40
    server.wait_idle()
    before = server.metrics()
    for _ in range(2):
        r = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    after = server.metrics()
    assert delta(before, after, "vllm:prefix_cache_queries_total") >= 2 * r.usage.prompt_tokens - 1
    hits = delta(before, after, "vllm:prefix_cache_hits_total")
    assert 0 < hits == r.usage.prompt_tokens_details.cached_tokens


def test_a_prefix_hit_restores_a_window_snapshot(server, openai_client):
    """The demo model is a DeepSeek-V4: the first request leaves its windows at its prompt's last block
    boundary, the second (a different ending) restores them there instead of replaying."""
    prompt = "Another prompt, long enough to fill whole blocks of the cache. " * 30
    server.wait_idle()
    before = server.metrics()
    for ending in (" First ending.", " Second ending."):
        r = openai_client.completions.create(model=MODEL, prompt=prompt + ending, max_tokens=1, temperature=0)
    after = server.metrics()
    assert r.usage.prompt_tokens_details.cached_tokens > 0
    hits = "deepinfer_window_snapshot_hits_total"  # ours: no model/engine labels
    assert after[hits] - before.get(hits, 0.0) == 1
    assert after["deepinfer_window_snapshots"] >= 1
    assert after["deepinfer_window_snapshot_bytes"] >= after["deepinfer_window_snapshots"] > 0


@pytest.mark.parametrize("stream", [False, True])
def test_each_finished_request_is_logged(server, openai_client, stream):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=2, seed=4, extra_body={"ignore_eos": True})
    if stream:
        chunks = list(openai_client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
        request_id, usage = chunks[0].id, chunks[-1].usage
    else:
        r = openai_client.completions.create(**kwargs)
        request_id, usage = r.id, r.usage
    pattern = (
        rf"Finished request {request_id}\S*: route=completions x_request_id=[0-9a-f]{{32}} status=200 "
        rf"prompt_tokens={usage.prompt_tokens} "
        rf"generation_tokens={usage.completion_tokens} finish_reason=length latency=\d"
    )
    deadline = time.monotonic() + 10  # a stream's last chunk reaches the client before its request is logged
    while not re.search(pattern, server.log()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert re.search(pattern, server.log()), server.log()[-2000:]
