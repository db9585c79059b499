"""Anthropic Messages sampling fields through the official anthropic client against a live server: top_k
(native to the protocol) and vLLM's extras reach the sampler exactly as on /v1/completions, max_tokens is
required, and what the protocol cannot do (n, guided decoding) is a 400 naming the field.
"""

from __future__ import annotations

import re

import anthropic
import deepseek_recipe as dr
import pytest

MODEL = "deepinfer-demo-deepseek-v4-random"
MESSAGES = [{"role": "user", "content": "tell me"}]
SPECIAL = re.compile(r"<｜[^｜]*｜>")


def message(client, *, extra_body: dict | None = None, **kwargs):
    """(the text, the message). Sampling fields go in the body: this SDK version has no temperature/top_k."""
    kwargs.setdefault("max_tokens", 8)
    body = {k: kwargs.pop(k) for k in ("temperature", "top_k") if k in kwargs}
    m = client.messages.create(model=MODEL, messages=MESSAGES, extra_body={**body, **(extra_body or {})}, **kwargs)
    return "".join(block.text for block in m.content if block.type == "text"), m


def reference(openai_client, recipe, **sampling) -> str:
    """/v1/completions on the token ids that /v1/messages feeds the engine."""
    _, encoding, options = recipe
    request = dr.MessagesRequest({"model": MODEL, "messages": MESSAGES, "max_tokens": 8})
    ids = encoding.encode(request.convert(options).conversation)
    return openai_client.completions.create(model=MODEL, prompt=ids, max_tokens=8, **sampling).choices[0].text


def test_top_k_1_is_greedy(anthropic_client):
    greedy, _ = message(anthropic_client, temperature=0)
    sampled, _ = message(anthropic_client, temperature=1.0, extra_body={"seed": 3})
    assert sampled != greedy
    top_k, _ = message(anthropic_client, temperature=1.0, top_k=1, extra_body={"seed": 3})
    assert top_k == greedy
    min_p, _ = message(anthropic_client, temperature=1.0, extra_body={"seed": 3, "min_p": 1.0})
    assert min_p == greedy


@pytest.mark.parametrize(
    "extra",
    [
        {"top_k": 4, "seed": 31},
        {"min_p": 0.4, "seed": 32},
        {"frequency_penalty": 2.0, "temperature": 0},
        {"presence_penalty": 2.0, "temperature": 0},
    ],
)
def test_fields_sample_exactly_as_completions(anthropic_client, openai_client, recipe, extra):
    sampling = {"temperature": 1.0, **extra}
    text, m = message(
        anthropic_client,
        temperature=sampling["temperature"],
        extra_body={k: v for k, v in sampling.items() if k != "temperature"},
    )
    completion_fields = {k: v for k, v in sampling.items() if k not in ("top_k", "min_p")}
    extra_completion = {k: v for k, v in sampling.items() if k in ("top_k", "min_p")}
    assert text == reference(openai_client, recipe, **completion_fields, extra_body=extra_completion)
    assert m.usage.output_tokens == 8


def test_penalties_change_the_greedy_answer(anthropic_client):
    plain, _ = message(anthropic_client, temperature=0)
    for extra in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 2.0}):
        assert message(anthropic_client, temperature=0, extra_body=extra)[0] != plain, extra


def test_skip_special_tokens(anthropic_client):
    for seed in range(40):
        kept, _ = message(anthropic_client, max_tokens=24, extra_body={"seed": seed, "skip_special_tokens": False})
        if SPECIAL.search(kept):
            break
    else:
        pytest.fail("no seed made the demo model emit a special token")
    skipped, m = message(anthropic_client, max_tokens=24, extra_body={"seed": seed})
    assert skipped == SPECIAL.sub("", kept) and m.usage.output_tokens == 24
    with anthropic_client.messages.stream(
        model=MODEL, messages=MESSAGES, max_tokens=24, extra_body={"seed": seed}
    ) as stream:
        assert "".join(stream.text_stream) == skipped


def test_bad_output_format_is_refused_by_name(anthropic_client):
    for bad in ({"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "schema": {"type": "nope"}}):
        with pytest.raises(anthropic.BadRequestError) as err:
            message(anthropic_client, output_config={"format": bad})
        assert "output_config.format" in err.value.body["error"]["message"] or bad["type"] != "xml"
    # effort is taken: the request runs. Random weights may end the turn after one token, and which
    # token greedy picks can turn on a near-tie that the CPU's thread count decides: not asserted
    _, m = message(anthropic_client, max_tokens=2, temperature=0, output_config={"effort": "high"})
    assert m.stop_reason in ("max_tokens", "end_turn") and 1 <= m.usage.output_tokens <= 2
    assert m.stop_reason == "end_turn" or m.usage.output_tokens == 2


def test_max_tokens_is_honoured(anthropic_client):
    _, m = message(anthropic_client, max_tokens=3, temperature=0)
    assert m.usage.output_tokens == 3 and m.stop_reason == "max_tokens"


def test_max_tokens_is_required(http):
    r = http.post("/v1/messages", json={"model": MODEL, "messages": MESSAGES})
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]


@pytest.mark.parametrize("value", [-3, 0, "5", 10**12])
def test_invalid_max_tokens_is_400(http, value):
    r = http.post("/v1/messages", json={"model": MODEL, "messages": MESSAGES, "max_tokens": value})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 2),
        ("best_of", 2),
        ("guided_json", {"type": "object"}),
        ("guided_regex", "a+"),
        ("logit_bias", {"5": 1}),
        ("use_beam_search", True),
        ("top_k", -5),
        ("min_p", 2),
        ("repetition_penalty", -1),
        ("ignore_eos", "no"),
        ("output_format", {"type": "xml"}),
    ],
)
def test_refused_and_bad_fields_are_400_naming_them(anthropic_client, field, value):
    with pytest.raises(anthropic.BadRequestError) as err:
        message(anthropic_client, max_tokens=2, extra_body={field: value})
    assert err.value.body["type"] == "error" and field in err.value.body["error"]["message"]


def test_non_sampling_fields_are_accepted(anthropic_client):
    _, m = message(anthropic_client, max_tokens=2, temperature=0, metadata={"user_id": "u1"}, extra_body={"n": 1})
    assert m.usage.output_tokens == 2
