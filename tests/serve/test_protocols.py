"""The four endpoints, streamed and not, through the official openai and anthropic clients against a live
server: response shapes, usage counts, finish reasons, seeds, logprobs and stop sequences.

The demo model has random weights: its text is meaningless, so the tests check structure and consistency
(same seed -> same text, stream == non-stream, usage == what was streamed), never content.
"""

from __future__ import annotations

import json

import pytest

MODEL = "deepinfer-demo-deepseek-v4-random"
MESSAGES = [{"role": "user", "content": "tell me"}]  # greedy decoding of it gives visible text
GREEDY = {"temperature": 0}


def check_chat_usage(usage, max_tokens: int, finish_reason: str) -> None:
    assert usage.prompt_tokens > 0
    assert 1 <= usage.completion_tokens <= max_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert finish_reason in ("length", "stop")
    if finish_reason == "length":
        assert usage.completion_tokens == max_tokens


def test_models_lists_the_served_model(openai_client):
    models = openai_client.models.list()
    assert [m.id for m in models.data] == [MODEL]


# ---- Chat Completions ---------------------------------------------------------------------------------------


def test_chat_non_streaming_shape_usage_and_logprobs(openai_client):
    r = openai_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, seed=11, logprobs=True, top_logprobs=3
    )
    assert r.object == "chat.completion" and r.model == MODEL and r.id
    [choice] = r.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    check_chat_usage(r.usage, 6, choice.finish_reason)
    content = choice.logprobs.content
    assert choice.finish_reason == "length" and len(content) == r.usage.completion_tokens == 6  # seeded: no EOS
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        best = [t.logprob for t in entry.top_logprobs]
        assert best == sorted(best, reverse=True) and entry.logprob <= best[0] + 1e-4


def test_chat_without_logprobs_has_none(openai_client):
    r = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **GREEDY)
    assert r.choices[0].logprobs is None


def test_chat_streaming_with_usage_matches_non_streaming(openai_client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=5, seed=5)
    whole = openai_client.chat.completions.create(**kwargs)
    chunks = list(openai_client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks and all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1 and chunks[-1].usage is not None  # usage comes with (or after) the last choice
    assert [c for c in chunks if c.usage is not None] == [chunks[-1]]
    check_chat_usage(chunks[-1].usage, 5, finishes[0])
    assert text == whole.choices[0].message.content  # same seed: the same tokens, streamed or not
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert getattr(chunks[-1].usage, key) == getattr(whole.usage, key)


def test_chat_seed_reproducible_at_temperature_1(openai_client):
    def text(seed: int) -> str:
        r = openai_client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=seed
        )
        return r.choices[0].message.content

    first = text(1234)
    assert text(1234) == first
    assert text(4321) != first


def test_chat_stop_sequence_cuts_the_text(openai_client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=12, seed=7)
    full = openai_client.chat.completions.create(**kwargs, logprobs=True).choices[0]
    tokens = [t.token for t in full.logprobs.content]
    stop = next(t for t in tokens[4:] if t.strip())  # a visible token in the middle of the answer
    expected = full.message.content[: full.message.content.index(stop)]
    cut = openai_client.chat.completions.create(**kwargs, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == expected
    assert cut.usage.completion_tokens < 12
    streamed = openai_client.chat.completions.create(**kwargs, stop=[stop], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected


# ---- Responses ----------------------------------------------------------------------------------------------


def test_responses_non_streaming(openai_client):
    r = openai_client.responses.create(model=MODEL, input="tell me", max_output_tokens=6, **GREEDY)
    assert r.object == "response" and r.model == MODEL
    assert r.status in ("completed", "incomplete")
    assert isinstance(r.output_text, str) and r.output_text
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    u = r.usage
    assert u.input_tokens > 0 and 1 <= u.output_tokens <= 6 and u.total_tokens == u.input_tokens + u.output_tokens
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens" and u.output_tokens == 6


def test_responses_streaming_events(openai_client):
    whole = openai_client.responses.create(model=MODEL, input="tell me", max_output_tokens=6, **GREEDY)
    events = list(
        openai_client.responses.create(model=MODEL, input="tell me", max_output_tokens=6, stream=True, **GREEDY)
    )
    types = [e.type for e in events]
    assert types[0] == "response.created"
    assert types[-1] in ("response.completed", "response.incomplete")
    assert types.count("response.completed") + types.count("response.incomplete") == 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    [done] = [e for e in events if e.type == "response.output_text.done"]
    final = events[-1].response
    assert deltas == done.text == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens and final.usage.input_tokens > 0
    assert final.status == whole.status


# ---- legacy Completions -------------------------------------------------------------------------------------


def test_completions_non_streaming_with_logprobs(openai_client):
    r = openai_client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, logprobs=2, seed=3)
    assert r.object == "text_completion" and r.model == MODEL
    [choice] = r.choices
    assert isinstance(choice.text, str) and choice.text
    check_chat_usage(r.usage, 6, choice.finish_reason)
    lp = choice.logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)  # the chosen token + the top 2 (OpenAI)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_completions_streaming_matches_non_streaming(openai_client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=5, seed=9)
    whole = openai_client.completions.create(**kwargs)
    chunks = list(openai_client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert whole.choices[0].logprobs is None and all(c.choices[0].logprobs is None for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert usage_chunks == [chunks[-1]] and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens > 0


def test_completions_seed_and_stop(openai_client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=1.0)
    first = openai_client.completions.create(**kwargs, seed=77, logprobs=0).choices[0]
    assert openai_client.completions.create(**kwargs, seed=77).choices[0].text == first.text
    assert openai_client.completions.create(**kwargs, seed=78).choices[0].text != first.text
    stop = next(t for t in first.logprobs.tokens[3:] if t.strip())
    cut = openai_client.completions.create(**kwargs, seed=77, stop=stop).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == first.text[: first.text.index(stop)]
    streamed = openai_client.completions.create(**kwargs, seed=77, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.text  # the stop string is not streamed


def test_completions_accepts_token_ids(openai_client, recipe):
    tokenizer = recipe[0]
    ids = tokenizer.encode("Once upon a time")
    r = openai_client.completions.create(model=MODEL, prompt=ids, max_tokens=2, **GREEDY)
    assert r.usage.prompt_tokens == len(ids)


# ---- Anthropic Messages -------------------------------------------------------------------------------------


def test_messages_non_streaming(anthropic_client):
    m = anthropic_client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=6, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert [block.type for block in m.content] == ["text"] and m.content[0].text
    assert m.usage.input_tokens > 0 and 1 <= m.usage.output_tokens <= 6
    assert m.stop_reason in ("max_tokens", "end_turn")
    if m.stop_reason == "max_tokens":
        assert m.usage.output_tokens == 6


def test_messages_stream_text_stream(anthropic_client):
    whole = anthropic_client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=6, extra_body=GREEDY)
    with anthropic_client.messages.stream(model=MODEL, messages=MESSAGES, max_tokens=6, extra_body=GREEDY) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens > 0


def test_messages_raw_event_sequence(http):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "stream": True, **GREEDY}
    with http.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert events[-2] == "message_delta" and "content_block_delta" in events


def test_messages_stop_sequence(anthropic_client):
    whole = anthropic_client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=8, extra_body=GREEDY)
    text = whole.content[0].text
    # two characters from the middle whose first occurrence is past the start (text before the stop exists)
    stop = next(
        text[i : i + 2]
        for i in range(len(text) // 2, len(text) - 1)
        if text[i : i + 2].strip() and text.index(text[i : i + 2]) > 0
    )
    m = anthropic_client.messages.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, stop_sequences=[stop], extra_body=GREEDY
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[: text.index(stop)]
    assert m.usage.output_tokens < 8


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"])
def test_streams_are_server_sent_events(http, path):
    body = {"model": MODEL, "stream": True, "max_tokens": 2, **GREEDY}
    if path == "/v1/completions":
        body["prompt"] = "hi"
    elif path == "/v1/responses":
        body = {"model": MODEL, "stream": True, "max_output_tokens": 2, "input": "hi", **GREEDY}
    else:
        body["messages"] = MESSAGES
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert data
    if path in ("/v1/chat/completions", "/v1/completions"):
        assert data[-1] == "[DONE]"
        data = data[:-1]
    for payload in data:
        json.loads(payload)
