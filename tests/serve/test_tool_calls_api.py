"""Tool calls held to their tools' schemas (issue #19) over HTTP, with the official openai and anthropic clients
against a live server on the demo model. Its weights are random: without the tool-call grammar no answer would
be a call that parses, let alone one that validates (the unconstrained control below). The schemas bound every
value (enums, bounded integers, a string with maxLength) so a random model finishes its calls; they reach one
object through `$defs` / `$ref`, which deepseek-recipe's rewrite of a strict schema drops (the grammar uses the
request's own schema) and the maxLength the rewrite drops holds too."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

MODEL = "deepinfer-demo-deepseek-v4-random"
MESSAGES = [{"role": "user", "content": "What is the weather, and what time is it?"}]
WEATHER = {
    "type": "object",
    "properties": {
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "place": {"type": "string", "maxLength": 8},
        "detail": {"$ref": "#/$defs/Detail"},
    },
    "required": ["unit", "days", "place", "detail"],
    "additionalProperties": False,
    "$defs": {
        "Detail": {
            "type": "object",
            "properties": {"hourly": {"type": "boolean"}},
            "required": ["hourly"],
            "additionalProperties": False,
        }
    },
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
    "required": ["zone"],
    "additionalProperties": False,
}


class Detail(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hourly: bool


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")
    unit: Literal["c", "f"]
    days: int = Field(ge=1, le=7)
    place: str = Field(max_length=8)
    detail: Detail


class Clock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    zone: Literal["utc", "cet"]


ARGUMENTS = {"weather": Weather, "clock": Clock}
ARGS_SCHEMAS = (("weather", WEATHER), ("clock", CLOCK))


def chat_tools(strict: bool = True) -> list[dict]:
    return [
        {"type": "function", "function": {"name": name, "parameters": schema, "strict": strict}}
        for name, schema in (("weather", WEATHER), ("clock", CLOCK))
    ]


def check_call(name: str, arguments: str | dict) -> None:
    """The call names a tool of the request and its arguments validate against that tool's schema."""
    assert name in ARGUMENTS, name
    model = ARGUMENTS[name]
    model.model_validate(arguments) if isinstance(arguments, dict) else model.model_validate_json(arguments)


def chat(openai_client, **kwargs):
    kwargs = {"max_tokens": 300, "temperature": 1.0, **kwargs}
    return openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs).choices[0]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_tool_choice_required_gives_calls_that_validate(openai_client, seed):
    # parallel calls: a random model chains a few (each call about 50 tokens); room for many
    choice = chat(openai_client, tools=chat_tools(), tool_choice="required", seed=seed, max_tokens=1500)
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        check_call(call.function.name, call.function.arguments)


def test_a_named_tool_is_the_one_call_and_streams(openai_client):
    named = {"type": "function", "function": {"name": "clock"}}
    choice = chat(openai_client, tools=chat_tools(), tool_choice=named, parallel_tool_calls=False, seed=4)
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == ["clock"]
    check_call("clock", choice.message.tool_calls[0].function.arguments)
    stream = openai_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=1500, temperature=1.0, seed=5, stream=True,
        tools=chat_tools(strict=False), tool_choice={"type": "function", "function": {"name": "weather"}},
    )  # fmt: skip
    calls: dict[int, dict] = {}
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    assert calls and all(c["name"] == "weather" for c in calls.values())
    for call in calls.values():
        check_call(call["name"], call["arguments"])


def test_strict_tools_under_auto_give_text_or_calls_that_validate(openai_client):
    for seed in range(4):
        message = chat(openai_client, tools=chat_tools(), max_tokens=60, seed=seed).message
        for call in message.tool_calls or []:
            check_call(call.function.name, call.function.arguments)
        assert "DSML" not in (message.content or "")  # text never carries half a call


def test_without_a_forcing_choice_a_random_model_calls_nothing(openai_client):
    """The control: the same request with non-strict tools and tool_choice auto is not constrained."""
    for seed in (1, 2):
        message = chat(openai_client, tools=chat_tools(strict=False), max_tokens=60, seed=seed).message
        assert not message.tool_calls


def test_responses_tool_choice_required(openai_client):
    tools = [{"type": "function", "name": n, "parameters": s, "strict": True} for n, s in ARGS_SCHEMAS]
    response = openai_client.responses.create(
        model=MODEL,
        input="What time is it?",
        tools=tools,
        tool_choice="required",
        max_output_tokens=300,
        temperature=1.0,
        parallel_tool_calls=False,
        extra_body={"seed": 2},
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1, response.output
    assert calls, response.output
    for call in calls:
        check_call(call.name, call.arguments)


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "weather"}])
def test_anthropic_tool_choice_any_and_tool_give_tool_use_blocks_that_validate(anthropic_client, tool_choice):
    """One call each (disable_parallel_tool_use: with parallel calls a random model may chain calls past any
    budget), seeded."""
    tools = [{"name": name, "input_schema": schema} for name, schema in ARGS_SCHEMAS]
    message = anthropic_client.messages.create(
        model=MODEL, messages=MESSAGES, max_tokens=300, tools=tools,
        tool_choice={**tool_choice, "disable_parallel_tool_use": True},
        extra_body={"temperature": 1.0, "seed": 3},  # this SDK version has no temperature argument
    )  # fmt: skip
    assert len([block for block in message.content if block.type == "tool_use"]) == 1, message.content
    uses = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and uses, message.content
    for block in uses:
        check_call(block.name, block.input)
        if tool_choice["type"] == "tool":
            assert block.name == "weather"


def test_responses_text_format_and_messages_output_config_follow_the_schema(openai_client, anthropic_client):
    response = openai_client.responses.create(
        model=MODEL, input="What time is it?", max_output_tokens=60, temperature=1.0, extra_body={"seed": 4},
        text={"format": {"type": "json_schema", "name": "clock", "schema": CLOCK, "strict": True}},
    )  # fmt: skip
    Clock.model_validate_json(response.output_text)
    message = anthropic_client.messages.create(
        model=MODEL, messages=MESSAGES, max_tokens=60,
        extra_body={"temperature": 1.0, "seed": 5,
                    "output_config": {"format": {"type": "json_schema", "schema": WEATHER}}},
    )  # fmt: skip
    Weather.model_validate_json(message.content[0].text)


def test_a_bad_tool_schema_is_a_400_naming_tools(openai_client):
    import openai

    bad = [{"type": "function", "function": {"name": "x", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["n"]}}}]  # fmt: skip
    with pytest.raises(openai.BadRequestError) as err:
        chat(openai_client, tools=bad, tool_choice="required")
    assert err.value.body["param"] == "tools", err.value.body
    assert json.dumps(err.value.body)  # an error in the protocol's format, not a traceback


def test_responses_stream_a_named_call_whose_arguments_validate(openai_client):
    """Streamed: the arguments arrive as response.function_call_arguments.delta events whose concatenation is
    the `done` event's (and the final response's) arguments, which validate."""
    tools = [{"type": "function", "name": n, "parameters": s, "strict": True} for n, s in ARGS_SCHEMAS]
    stream = openai_client.responses.create(
        model=MODEL, input="What is the weather?", tools=tools, tool_choice={"type": "function", "name": "weather"},
        max_output_tokens=300, temperature=1.0, parallel_tool_calls=False, extra_body={"seed": 6}, stream=True,
    )  # fmt: skip
    deltas, done, final = [], [], None
    for event in stream:
        if event.type == "response.function_call_arguments.delta":
            deltas.append(event.delta)
        elif event.type == "response.function_call_arguments.done":
            done.append(event.arguments)
        elif event.type == "response.completed":
            final = event.response
    assert len(done) == 1 and "".join(deltas) == done[0], (deltas, done)
    calls = [item for item in final.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["weather"] and calls[0].arguments == done[0]
    check_call("weather", done[0])


def test_anthropic_stream_a_tool_use_block_whose_input_validates(anthropic_client):
    """Streamed: a tool_use content block whose input_json_delta parts make the input, which validates (the SDK's
    own accumulation, get_final_message, agrees)."""
    tools = [{"name": name, "input_schema": schema} for name, schema in ARGS_SCHEMAS]
    with anthropic_client.messages.stream(
        model=MODEL, messages=MESSAGES, max_tokens=300, tools=tools,
        tool_choice={"type": "tool", "name": "clock", "disable_parallel_tool_use": True},
        extra_body={"temperature": 1.0, "seed": 7},
    ) as stream:  # fmt: skip
        parts = [
            e.delta.partial_json
            for e in stream
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
        ]
        message = stream.get_final_message()
    uses = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and [u.name for u in uses] == ["clock"], message.content
    assert json.loads("".join(parts)) == uses[0].input
    check_call("clock", uses[0].input)
