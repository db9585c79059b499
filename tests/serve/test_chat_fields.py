"""Chat Completions (and Responses) sampling fields through the official openai client against a live server:
every accepted field reaches the sampler exactly as on /v1/completions, refused ones are 400s naming
them, stop strings wait for min_tokens (Messages' too), the output limit is honoured, `n` gives n choices,
and usage comes where OpenAI puts it.

The demo model has random weights; its greedy answer to MESSAGES repeats a few tokens, which is what the
penalties act on. References come from /v1/completions fed the token ids of the same encoded
conversation, or from greedy decoding (top_k=1 and min_p=1 must reproduce it at temperature 1).
"""

from __future__ import annotations

import re

import deepseek_recipe as dr
import openai
import pytest

MODEL = "deepinfer-demo-deepseek-v4-random"
MESSAGES = [{"role": "user", "content": "tell me"}]
SAMPLED = {"temperature": 1.0, "seed": 3}
SPECIAL = re.compile(r"<｜[^｜]*｜>")  # a DeepSeek special-token spelling, e.g. <｜place▁holder▁no▁5｜>


def chat(client, **kwargs):
    kwargs.setdefault("max_tokens", 8)
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)


def prompt_ids(recipe, body: dict | None = None) -> list[int]:
    """The server's encoding of the chat conversation (what /v1/chat/completions feeds the engine)."""
    _, encoding, options = recipe
    request = dr.ChatCompletionRequest({"model": MODEL, "messages": MESSAGES, **(body or {})})
    return encoding.encode(request.convert(options).conversation)


def completion(client, recipe, **kwargs):
    """The same prompt through /v1/completions, as token ids."""
    kwargs.setdefault("max_tokens", 8)
    return client.completions.create(model=MODEL, prompt=prompt_ids(recipe), **kwargs).choices[0]


# ---- every honoured field reaches the sampler --------------------------------------------------------------


def test_prompt_encoding_is_the_one_the_references_use(openai_client, recipe):
    assert chat(openai_client, max_tokens=1, temperature=0).usage.prompt_tokens == len(prompt_ids(recipe))


@pytest.mark.parametrize("extra", [{"top_k": 1}, {"min_p": 1.0}])
def test_top_k_1_and_min_p_1_are_greedy(openai_client, extra):
    greedy = chat(openai_client, temperature=0).choices[0].message.content
    sampled = chat(openai_client, temperature=1.0, seed=3).choices[0].message.content
    assert sampled != greedy  # so the filter below is what makes it greedy
    assert chat(openai_client, temperature=1.0, seed=3, extra_body=extra).choices[0].message.content == greedy


@pytest.mark.parametrize(
    "fields",
    [
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"top_k": 5, "temperature": 1.0, "seed": 21},
        {"min_p": 0.5, "temperature": 1.0, "seed": 22},
        {"top_p": 0.5, "temperature": 1.0, "seed": 23},
        {"frequency_penalty": -1.5, "top_k": 3, "temperature": 0.8, "seed": 24},
        {"repetition_penalty": 1.5},
        {"repetition_penalty": 0.7, "min_p": 0.2, "temperature": 1.0, "seed": 25},
    ],
)
def test_fields_sample_exactly_as_completions(openai_client, recipe, fields):
    fields = {"temperature": 0, **fields}
    vllm_only = ("top_k", "min_p", "repetition_penalty")
    openai_fields = {k: v for k, v in fields.items() if k not in vllm_only}
    extra = {k: v for k, v in fields.items() if k in vllm_only}
    answer = chat(openai_client, **openai_fields, extra_body=extra)
    reference = completion(openai_client, recipe, **openai_fields, extra_body=extra)
    assert answer.choices[0].message.content == reference.text
    assert answer.usage.completion_tokens == 8


def test_penalties_change_the_greedy_answer(openai_client):
    plain = chat(openai_client, temperature=0).choices[0].message.content
    assert chat(openai_client, temperature=0, frequency_penalty=2.0).choices[0].message.content != plain
    assert chat(openai_client, temperature=0, presence_penalty=2.0).choices[0].message.content != plain
    assert (
        chat(openai_client, temperature=0, extra_body={"repetition_penalty": 2.0}).choices[0].message.content != plain
    )


def first_single_token(client, recipe) -> tuple[int, int]:
    """(position, id) of the first output token (of SAMPLED) that appears there first and round-trips
    through the tokenizer as one id."""
    tokens = chat(client, **SAMPLED, logprobs=True).choices[0].logprobs.content
    tokenizer = recipe[0]
    for position, entry in enumerate(tokens[1:], start=1):
        ids = tokenizer.encode(entry.token)
        if len(ids) == 1 and entry.token not in [t.token for t in tokens[:position]]:
            return position, ids[0]
    pytest.fail(f"no single-id token in {[t.token for t in tokens]}")


def test_stop_token_ids_and_min_tokens(openai_client, recipe):
    position, token = first_single_token(openai_client, recipe)
    cut = chat(openai_client, **SAMPLED, extra_body={"stop_token_ids": [token]})
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == position + 1
    held = chat(openai_client, **SAMPLED, extra_body={"stop_token_ids": [token], "min_tokens": 8})
    assert held.usage.completion_tokens == 8 and held.choices[0].finish_reason == "length"


def greedy_tokens(client) -> list[str]:
    return [t.token for t in chat(client, temperature=0, max_tokens=12, logprobs=True).choices[0].logprobs.content]


def stop_strings(tokens: list[str]) -> list[str]:
    """The greedy answer's first token (it repeats), and a string the cut of which falls inside a token."""
    first = tokens[0]
    return [first, first[3:] + tokens[1][:3]]


@pytest.mark.parametrize("which", [0, 1])
def test_stop_strings_wait_for_min_tokens(openai_client, recipe, which):
    """The engine alone applies stop strings, and only after min_tokens (vLLM): text before that keeps the
    stop string, and the answer ends where /v1/completions, fed the same prompt ids, ends it."""
    tokens = greedy_tokens(openai_client)
    stop = stop_strings(tokens)[which]
    assert tokens[0] in tokens[1:4] and stop in "".join(tokens[:3])  # the greedy answer repeats its first token
    early = chat(openai_client, temperature=0, max_tokens=12, stop=[stop])
    assert early.choices[0].finish_reason == "stop" and early.usage.completion_tokens <= 2
    for min_tokens in (4, 7):
        kwargs = dict(temperature=0, max_tokens=12, stop=[stop], extra_body={"min_tokens": min_tokens})
        answer = chat(openai_client, **kwargs)
        reference = completion(openai_client, recipe, **kwargs)
        assert reference.finish_reason == "stop" and reference.model_extra["stop_reason"] == stop
        choice = answer.choices[0]
        assert choice.finish_reason == "stop" and choice.message.content == reference.text
        assert min_tokens < answer.usage.completion_tokens < 12 and stop in choice.message.content
        streamed = list(chat(openai_client, **kwargs, n=2, stream=True, stream_options={"include_usage": True}))
        texts, finishes = ["", ""], [[], []]
        for chunk in streamed:
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                finishes[c.index] += [c.finish_reason] if c.finish_reason else []
        assert texts == [reference.text] * 2 and finishes == [["stop"], ["stop"]]
        assert streamed[-1].usage.completion_tokens == 2 * answer.usage.completion_tokens


def test_messages_stop_sequence_waits_for_min_tokens(openai_client, anthropic_client, recipe):
    """Messages too: the stop sequence ends the answer after min_tokens, and is still named as the reason."""
    stop = greedy_tokens(openai_client)[0]
    _, encoding, options = recipe
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12}
    ids = encoding.encode(dr.MessagesRequest(body).convert(options).conversation)
    extra = {"temperature": 0, "min_tokens": 5}
    reference = openai_client.completions.create(model=MODEL, prompt=ids, max_tokens=12, stop=[stop], extra_body=extra)
    m = anthropic_client.messages.create(**body, stop_sequences=[stop], extra_body=extra)
    assert m.content[0].text == reference.choices[0].text and stop in m.content[0].text
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.usage.output_tokens == reference.usage.completion_tokens > 5
    with anthropic_client.messages.stream(**body, stop_sequences=[stop], extra_body=extra) as streamed:
        assert "".join(streamed.text_stream) == m.content[0].text
        final = streamed.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_skip_special_tokens(openai_client):
    """The demo model emits special placeholder tokens: left out by default, kept on request (vLLM)."""
    for seed in range(40):
        kept = chat(openai_client, max_tokens=24, seed=seed, extra_body={"skip_special_tokens": False})
        if SPECIAL.search(kept.choices[0].message.content):
            break
    else:
        pytest.fail("no seed made the demo model emit a special token")
    skipped = chat(openai_client, max_tokens=24, seed=seed)
    assert not SPECIAL.search(skipped.choices[0].message.content)
    assert skipped.choices[0].message.content == SPECIAL.sub("", kept.choices[0].message.content)
    assert skipped.usage.completion_tokens == kept.usage.completion_tokens == 24  # skipped tokens still count
    streamed = chat(openai_client, max_tokens=24, seed=seed, stream=True)
    assert (
        "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == skipped.choices[0].message.content
    )


# ---- the output limit --------------------------------------------------------------------------------------


def test_max_completion_tokens_is_honoured(openai_client):
    r = chat(openai_client, max_tokens=None, max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    streamed = list(
        chat(
            openai_client,
            max_tokens=None,
            max_completion_tokens=3,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert streamed[-1].usage.completion_tokens == 3


def test_max_completion_tokens_wins_over_max_tokens(openai_client):
    """vLLM's rule: max_completion_tokens when given, else the deprecated max_tokens."""
    r = chat(openai_client, max_tokens=7, max_completion_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2
    assert chat(openai_client, max_tokens=4, temperature=0).usage.completion_tokens == 4


@pytest.mark.parametrize("value", [-3, 0, 10**12, "5", 2.5, True])
@pytest.mark.parametrize("field", ["max_completion_tokens", "max_tokens"])
def test_invalid_output_limits_are_400_naming_the_field(http, field, value):
    body = {"model": MODEL, "messages": MESSAGES, field: value}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"]
    if value == 10**12:
        assert "maximum context length" in error["message"]


def test_limit_beyond_the_remaining_context_is_400(http, recipe):
    room = 2048 - len(prompt_ids(recipe))  # the prompt fits, the prompt and the limit do not
    too_many = {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": room + 1}
    r = http.post("/v1/chat/completions", json=too_many)
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "max_completion_tokens"


@pytest.fixture(scope="module")
def small_context(start_server):
    """A 48-token context: a request without a limit runs to its end, which is quick to reach."""
    server = start_server("--max-model-len", "48", "--num-kv-blocks", "16")
    client = openai.OpenAI(
        base_url=server.url + "/v1",
        api_key="unused",
        max_retries=0,
        default_headers={"Connection": "close"},
        timeout=120,
    )
    yield client
    client.close()


def test_absent_limit_is_the_rest_of_the_context(small_context, recipe):
    r = small_context.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0)
    assert r.usage.completion_tokens == 48 - len(prompt_ids(recipe))
    assert r.choices[0].finish_reason == "length"


# ---- refused and ignored fields ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("best_of", 2),
        ("guided_json", {"type": "object"}),
        ("guided_regex", "a+"),
        ("guided_choice", ["a", "b"]),
        ("guided_grammar", "root ::= 'a'"),
        ("logit_bias", {"100": 5}),
        ("use_beam_search", True),
        ("prompt_logprobs", 1),
        ("allowed_token_ids", [1, 2]),
        ("bad_words", ["x"]),
        ("include_stop_str_in_output", True),
    ],
)
def test_unsupported_fields_are_400_naming_them(openai_client, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        chat(openai_client, max_tokens=2, extra_body={field: value})
    assert err.value.body["param"] == field and field in err.value.body["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", -2),
        ("top_k", 1.5),
        ("min_p", 1.5),
        ("repetition_penalty", 0),
        ("frequency_penalty", 2.5),
        ("presence_penalty", "high"),
        ("min_tokens", -1),
        ("min_tokens", 9),  # more than max_tokens
        ("stop_token_ids", [-1]),
        ("stop_token_ids", "1"),
        ("ignore_eos", "yes"),
        ("skip_special_tokens", 1),
        ("n", 0),
        ("n", "2"),
        ("seed", "1"),
    ],
)
def test_bad_sampling_values_are_400_naming_the_field(openai_client, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        chat(openai_client, extra_body={field: value})
    assert err.value.body["param"] == field and field in err.value.body["message"]


def test_non_sampling_fields_are_accepted(openai_client):
    r = chat(
        openai_client,
        max_tokens=2,
        temperature=0,
        user="u1",
        metadata={"k": "v"},
        store=False,
        service_tier="auto",
        parallel_tool_calls=True,
        response_format={"type": "text"},
        extra_body={"use_beam_search": False, "logit_bias": {}},
    )
    assert r.usage.completion_tokens == 2


def test_a_body_error_says_invalid_request_body_once(http):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": 5, "max_tokens": 2})
    assert r.status_code == 400
    assert r.json()["error"]["message"].count("invalid request body") == 1


# ---- n -----------------------------------------------------------------------------------------------------


def test_n_choices(openai_client):
    one = chat(openai_client, temperature=1.0, seed=5)
    r = chat(openai_client, temperature=1.0, seed=5, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert texts[0] == one.choices[0].message.content  # sample 0 keeps the seed
    assert len(set(texts)) == 3  # each choice is its own sample
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 3 * 8 and r.usage.prompt_tokens == one.usage.prompt_tokens


def test_n_choices_streamed(openai_client):
    whole = chat(openai_client, temperature=1.0, seed=6, n=2)
    chunks = list(
        chat(openai_client, temperature=1.0, seed=6, n=2, stream=True, stream_options={"include_usage": True})
    )
    texts, finishes = ["", ""], [[], []]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
    assert texts == [c.message.content for c in whole.choices]
    assert finishes == [["length"], ["length"]]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_greedy_n_choices_are_equal(openai_client):
    greedy = chat(openai_client, temperature=0).choices[0].message.content
    r = chat(openai_client, temperature=0, n=2)
    assert [c.message.content for c in r.choices] == [greedy, greedy]


# ---- stream_options ----------------------------------------------------------------------------------------


def test_usage_only_in_its_own_last_chunk(openai_client):
    chunks = list(chat(openai_client, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])
    assert sum(1 for c in chunks for choice in c.choices if choice.finish_reason) == 1


def test_no_usage_without_include_usage(openai_client):
    assert all(c.usage is None for c in chat(openai_client, temperature=0, stream=True))


def test_continuous_usage_stats(openai_client):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(chat(openai_client, temperature=0, stream=True, stream_options=options))
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 8 and counts[0] < 8


def test_stream_options_without_stream_is_400(openai_client):
    with pytest.raises(openai.BadRequestError) as err:
        chat(openai_client, stream_options={"include_usage": True})
    assert err.value.body["param"] == "stream_options"


# ---- Responses: penalties reach the sampler and are echoed ------------------------------------------------


def test_responses_penalties_applied_and_echoed(openai_client, recipe):
    kwargs = dict(model=MODEL, input="tell me", max_output_tokens=8, temperature=0)
    plain = openai_client.responses.create(**kwargs)
    penalised = openai_client.responses.create(**kwargs, extra_body={"frequency_penalty": 2.0, "presence_penalty": 1.5})
    assert penalised.output_text != plain.output_text
    assert penalised.frequency_penalty == 2.0 and penalised.presence_penalty == 1.5
    assert plain.frequency_penalty == 0.0
    events = list(openai_client.responses.create(**kwargs, stream=True, extra_body={"frequency_penalty": 2.0}))
    assert events[-1].response.frequency_penalty == 2.0
    assert [e.sequence_number for e in events] == list(range(len(events)))
    _, encoding, options = recipe
    ids = encoding.encode(dr.ResponsesRequest({"model": MODEL, "input": "tell me"}).convert(options).conversation)
    reference = openai_client.completions.create(
        model=MODEL, prompt=ids, max_tokens=8, temperature=0, frequency_penalty=2.0, presence_penalty=1.5
    )
    assert penalised.output_text == reference.choices[0].text


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("n", 2, "n"),
        ("guided_json", {}, "guided_json"),
        ("text", {"format": {"type": "xml"}}, "text.format"),
        ("text", {"format": {"type": "json_schema", "name": "x"}}, "text.format"),
        ("structured_outputs", {"json": {}}, "structured_outputs"),
    ],
)
def test_responses_refusals(http, field, value, param):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, field: value}
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_responses_top_k_reaches_the_sampler(openai_client):
    kwargs = dict(model=MODEL, input="tell me", max_output_tokens=8)
    greedy = openai_client.responses.create(**kwargs, temperature=0).output_text
    sampled = openai_client.responses.create(**kwargs, temperature=1.0, extra_body={"seed": 3}).output_text
    topk1 = openai_client.responses.create(**kwargs, temperature=1.0, extra_body={"seed": 3, "top_k": 1}).output_text
    assert sampled != greedy and topk1 == greedy
