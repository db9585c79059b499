"""Structured outputs over HTTP with the official openai client against a live server on the demo model (random
weights: only the constraint makes its output valid): Chat Completions' response_format (json_schema from a
pydantic model through `parse`, json_object), vLLM's structured_outputs on chat and completions (regex, choice),
streamed and not; malformed or invalid constraints are 400s naming the field; Responses and Messages refuse vLLM's
object by name (their own format fields work: test_tool_calls_api.py); 100 concurrent streams, constrained and
not, all correct."""

from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

MODEL = "deepinfer-demo-deepseek-v4-random"
MESSAGES = [{"role": "user", "content": "Describe a person."}]


class Pet(BaseModel):
    kind: Literal["cat", "dog"]  # an enum the openai client's strict schema reaches through $defs / $ref
    legs: int = Field(ge=0, le=8)


class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=99)
    pet: Pet


def test_parse_with_a_pydantic_model_returns_the_parsed_object(openai_client):
    completion = openai_client.beta.chat.completions.parse(
        model=MODEL, messages=MESSAGES, response_format=Person, max_tokens=80, temperature=1.0, seed=3
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop", message.content
    assert isinstance(message.parsed, Person) and message.parsed.pet.kind in ("cat", "dog")
    assert Person.model_validate_json(message.content) == message.parsed


def test_json_object_and_an_unconstrained_control(openai_client):
    def ask(**kwargs):  # OpenAI's rule, which deepseek-recipe keeps: JSON mode needs "JSON" in the prompt
        messages = [{"role": "user", "content": "Describe a person in JSON."}]
        return openai_client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=40, temperature=1.0, seed=5, **kwargs
        ).choices[0]

    constrained = ask(response_format={"type": "json_object"})
    assert constrained.message.content.startswith("{")
    if constrained.finish_reason == "stop":
        assert isinstance(json.loads(constrained.message.content), dict)
    free = ask()
    assert not free.message.content.startswith("{")


def test_structured_outputs_on_completions_and_streamed_chat(openai_client):
    phone = r"[0-9]{3}-[0-9]{4}"
    text = (
        openai_client.completions.create(
            model=MODEL,
            prompt="Call",
            max_tokens=20,
            temperature=1.0,
            seed=1,
            extra_body={"structured_outputs": {"regex": phone}},
        )
        .choices[0]
        .text
    )
    assert re.fullmatch(phone, text), text
    stream = openai_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, temperature=1.0, seed=2, stream=True,
        extra_body={"structured_outputs": {"choice": ["sunny", "rainy"]}},
    )  # fmt: skip
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed in ("sunny", "rainy")


@pytest.mark.parametrize(
    ("extra", "param", "needle"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
        ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
        ({"structured_outputs": {"regex": "a(b"}}, None, "unclosed group"),
        ({"structured_outputs": {"json": {"type": "objectx"}}}, None, "objectx"),
        ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "regexp"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "response_format",
            "not both",
        ),
    ],
)
def test_bad_constraints_are_400s(openai_client, extra, param, needle):
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=extra)
    assert needle in err.value.body["message"]
    if param is not None:
        assert err.value.body["param"] == param


def test_routes_without_structured_outputs_refuse_by_name(server):
    import httpx

    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, "structured_outputs": {"regex": "a"}}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text


def test_compile_and_mask_times_are_histograms(openai_client, server):
    def counts() -> tuple[float, float]:
        samples = server.metrics()
        return tuple(
            server.value(f"deepinfer:structured_output_{name}_seconds_count", samples) for name in ("compile", "mask")
        )

    compiled, masked = counts()
    fresh = {"type": "object", "properties": {"metric_probe": {"enum": ["a", "b"]}}, "required": ["metric_probe"]}
    choice = openai_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, seed=4, extra_body={"structured_outputs": {"json": fresh}}
    ).choices[0]
    assert json.loads(choice.message.content) in ({"metric_probe": "a"}, {"metric_probe": "b"})
    after_compiled, after_masked = counts()
    assert after_compiled == compiled + 1  # a new schema: one compile
    assert after_masked >= masked + len(choice.message.content) // 8  # a mask per constrained token at least


def test_a_hundred_concurrent_streams_constrained_and_not(server):
    """100 streams at once, a quarter each: JSON Schema (response_format), regex (structured_outputs), a forced tool
    call, and unconstrained text; every constrained one validates, the unconstrained ones run to their limit, and
    the server logs no traceback."""
    import asyncio

    clock = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}}, "required": ["zone"],
             "additionalProperties": False}  # fmt: skip
    phone = r"[0-9]{3}-[0-9]{4}"

    async def one(client, i: int) -> tuple[str, str | None, str]:
        kind = ("json", "regex", "tool", "free")[i % 4]
        extra: dict = {}
        if kind == "json":
            extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": clock}}}
        elif kind == "regex":
            extra = {"extra_body": {"structured_outputs": {"regex": phone}}}
        elif kind == "tool":
            tool = {"type": "function", "function": {"name": "clock", "parameters": clock, "strict": True}}
            extra = {"tools": [tool], "tool_choice": "required", "parallel_tool_calls": False}
        stream = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=60 if kind != "free" else 12, temperature=1.0, seed=i,
            stream=True, **extra,
        )  # fmt: skip
        text, arguments, finish = "", "", None
        async for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            text += delta.content or ""
            for call in delta.tool_calls or []:
                arguments += call.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        return kind, finish, arguments if kind == "tool" else text

    async def run_all() -> list:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(100)))
        finally:
            await client.close()

    results = asyncio.run(run_all())
    for kind, finish, out in results:
        if kind == "json":
            assert finish == "stop" and json.loads(out)["zone"] in ("utc", "cet"), out
        elif kind == "regex":
            assert finish == "stop" and re.fullmatch(phone, out), out
        elif kind == "tool":
            assert finish == "tool_calls" and json.loads(out)["zone"] in ("utc", "cet"), out
        else:
            assert finish == "length" and out, out
    assert sum(1 for kind, _, out in results if kind == "free" and not out.startswith("{")) >= 20
    server.assert_no_tracebacks()
