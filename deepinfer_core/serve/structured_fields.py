"""The output constraint a request body asks for (structured outputs, issue #19): vLLM's `structured_outputs` object,
OpenAI's `response_format` (chat) / `text.format` (Responses), Anthropic's `output_config.format` (Messages); and
the tool calls a request forces (tool_choice required / named / Anthropic's any) or declares strict, held to the
tools' own parameter schemas (structured/tool_calls.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import deepseek_recipe as dr

from deepinfer_core.errors import RequestError
from deepinfer_core.serve.errors import ApiError
from deepinfer_core.structured import StructuredOutputError, StructuredOutputsParams
from deepinfer_core.structured.tool_calls import tool_call_grammar

__all__ = [
    "STRUCTURED_ROUTES",
    "check_compiles",
    "constraint_field",
    "request_constraint",
    "structured_outputs_from_body",
    "tool_call_outputs",
]

STRUCTURED_ROUTES = ("chat", "completions")  # where vLLM's structured_outputs object is read
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")
_FORMAT_KINDS = "json_object or json_schema"


def _vllm_object(body: dict) -> dict | None:
    given = body.get("structured_outputs")
    if given is None:
        return None
    if not isinstance(given, dict):
        raise ApiError(400, 'structured_outputs must be an object such as {"json": SCHEMA}', param="structured_outputs")
    if unknown := sorted(set(given) - set(_STRUCTURED_KEYS)):
        message = f"structured outputs has unknown keys {unknown}; it takes {', '.join(_STRUCTURED_KEYS)}"
        raise ApiError(400, message, param="structured_outputs")
    return dict(given)


def _format(form: Any, field: str, schema_of) -> dict | None:
    """A format object ({"type": "text" | "json_object" | "json_schema", ...}) -> structured outputs' keys, or None
    for text; `schema_of(form)` finds the schema of a json_schema one."""
    if form is None or (isinstance(form, dict) and form.get("type") == "text"):
        return None
    kind = form.get("type") if isinstance(form, dict) else None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        schema = schema_of(form)
        if not isinstance(schema, dict):
            raise ApiError(400, f"{field} of type json_schema needs its JSON Schema object (schema)", param=field)
        return {"json": schema}
    raise ApiError(400, f"{field}.type must be text, {_FORMAT_KINDS}, got {kind!r}", param=field)


def _chat_schema(form: dict) -> Any:  # response_format: {"type": "json_schema", "json_schema": {"schema": ...}}
    spec = form.get("json_schema")
    return spec.get("schema") if isinstance(spec, dict) else None


def _flat_schema(form: dict) -> Any:  # text.format / output_config.format: {"type": "json_schema", "schema": ...}
    return form.get("schema")


def _nested(body: dict, outer: str, inner: str) -> Any:
    value = body.get(outer)
    return value.get(inner) if isinstance(value, dict) else None


def structured_outputs_from_body(body: dict, route: str) -> StructuredOutputsParams | None:
    """The output constraint a body asks for, None for text. Chat / completions: vLLM's `structured_outputs`, or
    `response_format` (json_object; json_schema with the request's own schema, `$defs` and all); Responses:
    `text.format`; Messages: `output_config.format` (or the beta's `output_format`). A malformed one is a 400
    naming the field."""
    wanted, field = None, "structured_outputs"
    if route in STRUCTURED_ROUTES:
        wanted = _vllm_object(body)
        form = body.get("response_format")
        if form is not None and not (isinstance(form, dict) and form.get("type") == "text"):
            field = "response_format"
            if wanted is not None:
                raise ApiError(400, "give either response_format or structured_outputs, not both", param=field)
            wanted = _format(form, field, _chat_schema)
    elif route == "responses":
        field = "text.format"
        wanted = _format(_nested(body, "text", "format"), field, _flat_schema)
    elif route == "messages":
        field = "output_config.format" if _nested(body, "output_config", "format") is not None else "output_format"
        form = _nested(body, "output_config", "format") or body.get("output_format")
        wanted = _format(form, field, _flat_schema)
    if wanted is None:
        return None
    try:
        return StructuredOutputsParams(**wanted)
    except RequestError as err:
        raise ApiError(400, str(err), param=field) from None


def _body_tools(body: dict, route: str) -> dict[str, tuple[Any, bool]]:
    """{name: (parameters JSON Schema, strict)} of a body's function tools, in each protocol's spelling."""
    found = {}
    for tool in body.get("tools") or []:
        if not isinstance(tool, dict):
            continue
        if route == "chat":
            spec = tool.get("function") if tool.get("type", "function") == "function" else None
            spec = spec if isinstance(spec, dict) else {}
            name, params, strict = spec.get("name"), spec.get("parameters"), spec.get("strict")
        elif route == "messages":
            name, params, strict = tool.get("name"), tool.get("input_schema"), tool.get("strict")
        else:
            name, params, strict = tool.get("name"), tool.get("parameters"), tool.get("strict")
        if isinstance(name, str):
            found[name] = (params if isinstance(params, dict) else {}, strict is True)
    return found


def _parallel(body: dict, route: str) -> bool:
    if route == "messages":
        choice = body.get("tool_choice")
        return not (isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True)
    return body.get("parallel_tool_calls") is not False


def tool_call_outputs(body: dict, route: str, conv: dr.ConversationRequest) -> StructuredOutputsParams | None:
    """The grammar of the tool calls a request forces or declares strict (None: nothing to hold). The tools a
    call may name are those deepseek-recipe kept for the request (one for a named tool_choice); their schemas
    are the body's own."""
    constraint = conv.inference_options.output_constraint
    if constraint is None or constraint.kind not in ("tool_call", "tool_call_required"):
        return None
    tools = _body_tools(body, route)
    allowed = [entry.get("function", {}).get("name") for entry in _json_list(constraint.schema)]
    chosen = [(name, tools[name][0]) for name in allowed if name in tools]
    if not chosen:
        return None
    choice = body.get("tool_choice")
    if constraint.kind == "tool_call_required":
        mode = "opened" if conv.parsing_options.starts_in_tool_calls else "required"
    elif route == "messages" and isinstance(choice, dict) and choice.get("type") == "any":
        mode = "required"  # the recipe reads `any` as auto; Anthropic's is "use one of the tools"
    elif any(tools[name][1] for name, _ in chosen):
        mode = "auto"  # strict tools under tool_choice auto: text, or calls that follow the schemas
    else:
        return None
    return StructuredOutputsParams(grammar=tool_call_grammar(chosen, mode, _parallel(body, route)))


_REASONING_FIRST = (dr.ThinkingInitialStage.ReasoningStart, dr.ThinkingInitialStage.ReasoningContinuation)


def request_constraint(
    wanted: StructuredOutputsParams | None,
    body: dict,
    route: str,
    conv: dr.ConversationRequest,
    thinking_end: int | None,
) -> StructuredOutputsParams | None:
    """A request's structured output: the one its body asks for (`wanted`), or the tool calls it forces / declares
    strict; in thinking mode held from the end-of-thinking token (`thinking_end`) on."""
    wanted = wanted or tool_call_outputs(body, route, conv)
    if wanted is not None and conv.parsing_options.thinking_initial_stage in _REASONING_FIRST:
        if thinking_end is None:
            raise ApiError(400, "structured outputs in thinking mode need the tokenizer's end-of-thinking token")
        wanted = replace(wanted, reasoning_end_token_id=thinking_end)
    return wanted


def _json_list(text: str) -> list:
    try:
        value = json.loads(text)
    except ValueError:
        return []
    return [entry for entry in value if isinstance(entry, dict)] if isinstance(value, list) else []


def constraint_field(body: dict, route: str) -> str:
    """The body field a request's structured output came from (named in its errors): the format field when the
    body has one, else the tools (a tool-call grammar)."""
    if route in STRUCTURED_ROUTES:
        if body.get("structured_outputs") is not None:
            return "structured_outputs"
        form = body.get("response_format")
        return "response_format" if isinstance(form, dict) and form.get("type") != "text" else "tools"
    if route == "responses":
        return "text.format" if _nested(body, "text", "format") not in (None, {"type": "text"}) else "tools"
    if _nested(body, "output_config", "format") is not None:
        return "output_config.format"
    return "output_format" if body.get("output_format") is not None else "tools"


async def check_compiles(engine, wanted: StructuredOutputsParams | None, field: str) -> None:
    """Compile a request's constraint off the event loop (AsyncEngine.compile_structured) before it is submitted:
    a bad or too slow one is a 400 naming `field`."""
    if wanted is None:
        return
    try:
        await engine.compile_structured(wanted)
    except StructuredOutputError as err:
        raise ApiError(400, f"{field}: {err}", param=field) from None
