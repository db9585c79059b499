"""/v1/completions as vLLM serves it, through the official openai client against a live server: n samples,
best_of, prompt lists, echo (with the prompt's logprobs), stream usage, vLLM's sampling extras, refused
fields, and streaming that never sends part of a stop string.

The demo model has random weights: expected values come from other requests (single-prompt runs, n
samples vs best_of, a greedy step vs the echoed prompt's logprob), never from the code under test.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from deepinfer_core.engine.stops import held_back

MODEL = "deepinfer-demo-deepseek-v4-random"
PROMPT = "Once upon a time"
SAMPLED = {"temperature": 1.0, "seed": 21}


def create(client, **kwargs):
    return client.completions.create(model=MODEL, **kwargs)


def token_ids(http: httpx.Client, text: str) -> list[int]:
    r = http.post("/tokenize", json={"model": MODEL, "prompt": text})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


# ---- n and best_of --------------------------------------------------------------------------------------


def test_n_gives_distinct_indexed_choices_reproducibly(openai_client):
    r = create(openai_client, prompt=PROMPT, n=3, max_tokens=6, logprobs=0, **SAMPLED)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.text for c in r.choices]
    assert len(set(texts)) == 3, texts
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    again = create(openai_client, prompt=PROMPT, n=3, max_tokens=6, **SAMPLED)
    assert [c.text for c in again.choices] == texts  # seeded: the same samples
    single = create(openai_client, prompt=PROMPT, max_tokens=6, **SAMPLED)
    assert single.choices[0].text == texts[0]  # sample 0 of n keeps the request's seed


def cumulative(choice) -> float:
    return sum(choice.logprobs.token_logprobs)


def test_best_of_keeps_the_highest_cumulative_logprob(openai_client):
    for seed in range(10):  # one where the best of 4 is not sample 0 and no two are tied
        kwargs = dict(prompt=PROMPT, max_tokens=6, temperature=1.0, seed=seed)
        drawn = create(openai_client, n=4, logprobs=0, **kwargs).choices
        ranked = sorted(drawn, key=cumulative, reverse=True)
        gaps = [cumulative(a) - cumulative(b) for a, b in zip(ranked, ranked[1:])]
        if ranked[0] is not drawn[0] and min(gaps) > 1e-3:
            break
    else:
        pytest.fail("no seed gave four samples with distinct cumulative logprobs and a best other than sample 0")
    best = create(openai_client, best_of=4, **kwargs)
    assert [c.text for c in best.choices] == [ranked[0].text]
    best_two = create(openai_client, n=2, best_of=4, logprobs=0, **kwargs).choices
    assert [c.index for c in best_two] == [0, 1]
    assert {c.text for c in best_two} == {c.text for c in ranked[:2]}


def test_best_of_cannot_be_streamed(openai_client):
    with pytest.raises(openai.BadRequestError) as err:
        create(openai_client, prompt=PROMPT, best_of=3, max_tokens=2, stream=True)
    assert err.value.body["param"] == "best_of"


# ---- prompt lists ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["strings", "token ids"])
def test_prompt_list_gives_each_prompts_choices(openai_client, http, kind):
    prompts = [PROMPT, "The weather today", "hello there"]
    if kind == "token ids":
        prompts = [token_ids(http, p) for p in prompts]
    r = create(openai_client, prompt=prompts, n=2, max_tokens=4, **SAMPLED)
    assert [c.index for c in r.choices] == list(range(6))
    prompt_tokens = completion_tokens = 0
    for i, prompt in enumerate(prompts):
        single = create(openai_client, prompt=prompt, n=2, max_tokens=4, **SAMPLED)
        assert [c.text for c in r.choices[2 * i : 2 * i + 2]] == [c.text for c in single.choices]
        prompt_tokens += single.usage.prompt_tokens
        completion_tokens += single.usage.completion_tokens
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, completion_tokens)


def test_prompt_list_streams_with_usage_last(openai_client):
    kwargs = dict(prompt=[PROMPT, "The weather today"], n=2, max_tokens=4, **SAMPLED)
    whole = create(openai_client, **kwargs)
    chunks = list(create(openai_client, stream=True, stream_options={"include_usage": True}, **kwargs))
    texts, finishes = {}, {}
    for chunk in chunks[:-1]:
        assert chunk.usage is None and chunk.choices
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert texts == {c.index: c.text for c in whole.choices}
    assert finishes == {c.index: [c.finish_reason] for c in whole.choices}  # once each
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens


@pytest.mark.parametrize("early_stop", [False, True])
def test_each_streamed_sample_finishes_once(openai_client, http, early_stop):
    """The engine's last report lists every sample again: one that finished earlier must not finish twice
    (sample 1 starts a step after sample 0; with early_stop, sample 0's third token ends it sooner still)."""
    kwargs = dict(prompt=PROMPT, n=2, max_tokens=6, **SAMPLED)
    extra = {}
    if early_stop:
        ids = create(openai_client, logprobs=0, extra_body={"return_tokens_as_token_ids": True}, **kwargs).choices
        extra = {"stop_token_ids": [int(ids[0].logprobs.tokens[2].removeprefix("token_id:"))]}
    whole = create(openai_client, extra_body=extra, **kwargs)
    body = {"model": MODEL, "stream": True, **kwargs, **extra}
    with http.stream("POST", "/v1/completions", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    finishes = {}
    for event in events:
        for choice in event["choices"]:
            if choice["finish_reason"] is not None:
                finishes.setdefault(choice["index"], []).append(choice["finish_reason"])
    assert finishes == {c.index: [c.finish_reason] for c in whole.choices}


# ---- echo ------------------------------------------------------------------------------------------------


def test_echo_prepends_the_prompt(openai_client):
    plain = create(openai_client, prompt=PROMPT, max_tokens=4, temperature=0).choices[0]
    echoed = create(openai_client, prompt=PROMPT, max_tokens=4, temperature=0, echo=True).choices[0]
    assert echoed.text == PROMPT + plain.text
    streamed = create(openai_client, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.text


def test_echo_with_logprobs_scores_the_prompt_tokens(openai_client, http):
    ids = token_ids(http, PROMPT)
    r = create(openai_client, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_echo_only_scores_a_prompt_like_a_generation_step(openai_client, http):
    """The logprob the echo gives a prompt's last token equals the logprob of generating that token."""
    ids = token_ids(http, PROMPT)
    as_ids = {"return_tokens_as_token_ids": True}
    step = create(openai_client, prompt=ids, max_tokens=1, temperature=0, logprobs=0, extra_body=as_ids)
    step_lp = step.choices[0].logprobs
    token = int(step_lp.tokens[0].removeprefix("token_id:"))
    scored = create(openai_client, prompt=[*ids, token], max_tokens=0, echo=True, logprobs=0).choices[0]
    assert scored.text.startswith(PROMPT) and scored.finish_reason == "length"
    assert len(scored.logprobs.token_logprobs) == len(ids) + 1
    assert scored.logprobs.token_logprobs[-1] == pytest.approx(step_lp.token_logprobs[0], abs=2e-3)


# ---- streaming and stop strings --------------------------------------------------------------------------


def test_held_back_is_the_longest_stop_prefix_at_the_end():
    assert held_back("ânt", ["ntân"]) == 2  # issue #14: "nt" may become "ntân"
    assert held_back("ântâ", ["ntân"]) == 3
    assert held_back("abc", ["xyz"]) == 0
    assert held_back("abc", ["c", "bcd"]) == 2  # a whole stop string is found by the engine, not held
    assert held_back("", ["ab"]) == 0


def test_streaming_never_sends_part_of_a_stop_string(openai_client):
    """A stop string that begins inside one token and ends in a later one: the first token's text must not be
    streamed whole, since the stop cuts it."""
    for seed in range(20):
        kwargs = dict(prompt=PROMPT, max_tokens=12, temperature=1.0, seed=seed)
        whole = create(openai_client, logprobs=0, **kwargs).choices[0]
        tokens = whole.logprobs.tokens
        if "".join(tokens) != whole.text:
            continue
        for k in range(len(tokens) - 1):
            stop = tokens[k][-2:] + tokens[k + 1][:2]
            start = sum(len(t) for t in tokens[: k + 1]) - 2
            if len(tokens[k]) >= 3 and len(tokens[k + 1]) >= 2 and whole.text.find(stop) == start:
                break
        else:
            continue
        cut = create(openai_client, stop=stop, **kwargs).choices[0]
        assert cut.finish_reason == "stop" and cut.text == whole.text[:start]
        streamed = list(create(openai_client, stop=stop, stream=True, **kwargs))
        assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.text
        return
    pytest.fail("no seed gave a stop string across two tokens")


# ---- vLLM's sampling extras ------------------------------------------------------------------------------


def test_stop_token_ids_end_the_text_with_a_stop_reason(openai_client):
    kwargs = dict(prompt=PROMPT, max_tokens=8, **SAMPLED)
    whole = create(openai_client, logprobs=0, extra_body={"return_tokens_as_token_ids": True}, **kwargs).choices[0]
    ids = [int(t.removeprefix("token_id:")) for t in whole.logprobs.tokens]
    third = ids[2]
    r = create(openai_client, extra_body={"stop_token_ids": [third]}, **kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and r.usage.completion_tokens == ids.index(third) + 1
    assert choice.model_extra["stop_reason"] == third
    held = create(openai_client, extra_body={"stop_token_ids": [third], "min_tokens": 8}, **kwargs)
    assert held.choices[0].finish_reason == "length" and held.usage.completion_tokens == 8


def test_repetition_penalty_and_top_k_reach_the_sampler(openai_client):
    kwargs = dict(prompt=PROMPT, max_tokens=8, temperature=0)
    plain = create(openai_client, **kwargs).choices[0].text
    penalised = create(openai_client, extra_body={"repetition_penalty": 1.8}, **kwargs).choices[0].text
    assert penalised != plain
    one = create(openai_client, prompt=PROMPT, max_tokens=8, temperature=1.5, seed=4, extra_body={"top_k": 1})
    assert one.choices[0].text == plain  # top_k 1 is greedy


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("suffix", "the end"),
        ("guided_json", {"type": "object"}),
        ("guided_regex", "a+"),
        ("logit_bias", {"100": 5}),
        ("use_beam_search", True),
    ],
)
def test_unsupported_fields_are_refused_by_name(openai_client, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        create(openai_client, prompt=PROMPT, max_tokens=2, extra_body={field: value})
    assert err.value.body["param"] == field and field in err.value.body["message"]


@pytest.mark.parametrize(
    "extra",
    [
        {"prompt": []},
        {"prompt": [[]]},
        {"prompt": ["a", 5]},
        {"prompt": [[1, 2], "a"]},
        {"n": 0},
        {"best_of": 1, "n": 2},
        {"min_tokens": 5, "max_tokens": 2},
        {"repetition_penalty": "high"},
        {"echo": "yes"},
        {"stream_options": {"include_usage": True}},  # without stream
        {"max_tokens": 0},  # without echo
    ],
)
def test_bad_values_are_400_naming_the_field(http, extra):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **extra}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] in extra, error
