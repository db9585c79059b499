"""Grammars for DeepSeek's tool calls (issue #19): the DSML text DeepSeek-V4's encoding expects, with each call's
arguments held to its tool's parameter schema.

A call block, as the encoding renders it (and deepseek-recipe parses it):

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

A string parameter is its raw text (`string="true"`, ended by the first closing tag); any other is JSON
(`string="false"`). Here a plain string (or one of an enum / const of strings) is raw text; any other schema,
a string with a pattern, format or length bounds included, is JSON held to the schema by llguidance's `%json`
(the recipe decodes both forms). Properties come in the schema's order, the required ones always, the others
optionally; properties the schema does not declare are never emitted. Each parameter's schema carries its tool's
`$defs` / `definitions`, so `$ref`s resolve (the schema is the request's own, not the recipe's rewrite).

Forms (`mode`): "opened": the prompt already ends in the block's opening (tool_choice required / a named tool:
the encoding writes it) -> one or more calls and the block's end; "required": the answer must be a call block
(Anthropic's tool_choice any, where the encoding opens nothing); "auto": any text without DSML markup, or text
then a call block (strict tools under tool_choice auto).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["TOOL_MODES", "tool_call_grammar"]

TOOL_MODES = ("opened", "required", "auto")
OPEN = "<｜DSML｜tool_calls>\n"
CLOSE = "</｜DSML｜tool_calls>"
_DEFS = ("$defs", "definitions")


def _lit(text: str) -> str:
    """A Lark string literal for `text`."""
    return json.dumps(text, ensure_ascii=False)


def _resolve(schema: Any, root: Mapping) -> Any:
    """A local `$ref` (#/$defs/X, #/definitions/X) of `schema` followed once, to read its type."""
    ref = schema.get("$ref") if isinstance(schema, Mapping) else None
    if isinstance(ref, str) and ref.startswith("#/"):
        node: Any = root
        for part in ref[2:].split("/"):
            node = node.get(part) if isinstance(node, Mapping) else None
        return node if isinstance(node, Mapping) else schema
    return schema


_STRING_LIMITS = ("pattern", "format", "minLength", "maxLength", "contentEncoding", "contentMediaType")


def _raw_string(schema: Any) -> list[str] | None:
    """For a schema that is a plain string: [] (any text), or its allowed strings (enum / const); else None."""
    if not isinstance(schema, Mapping):
        return None
    if "const" in schema:
        return [schema["const"]] if isinstance(schema["const"], str) else None
    if "enum" in schema:
        values = schema["enum"]
        return list(values) if values and all(isinstance(v, str) for v in values) else None
    if schema.get("type") == "string" and not any(k in schema for k in _STRING_LIMITS):
        return []
    return None


def _parameter(rules: list[str], rule: str, name: str, schema: Any, params: Mapping) -> None:
    """Rules for one parameter: `rule` matches its whole element."""
    resolved = _resolve(schema, params)
    strings = _raw_string(resolved)
    end = _lit("</｜DSML｜parameter>\n")
    if strings is not None:
        head = _lit(f'<｜DSML｜parameter name="{name}" string="true">')
        if strings:
            rules.append(f"{rule}: {head} ({' | '.join(_lit(s) for s in strings)}) {end}")
        else:  # any text up to the first closing tag: one lazy lexeme
            rules.append(f"{rule}: {head} {rule}_text")
            rules.append(f"{rule}_text[lazy]: /(?s:.*)/ {end}")
        return
    embedded = dict(schema) if isinstance(schema, Mapping) else {}
    for key in _DEFS:
        if key in params and key not in embedded:
            embedded[key] = params[key]
    embedded.setdefault("x-guidance", {"whitespace_flexible": False})
    head = _lit(f'<｜DSML｜parameter name="{name}" string="false">')
    rules.append(f"{rule}: {head} {rule}_json {end}")
    rules.append(f"{rule}_json: %json {json.dumps(embedded, ensure_ascii=False)}")


def _invoke(rules: list[str], index: int, name: str, params: Any) -> str:
    """Rules for a call of one tool; returns its rule name."""
    params = params if isinstance(params, Mapping) else {}
    properties = params.get("properties") if isinstance(params.get("properties"), Mapping) else {}
    required = set(params.get("required") or ())
    parts = []
    for j, (prop, schema) in enumerate(properties.items()):
        rule = f"p{index}_{j}"
        _parameter(rules, rule, prop, schema, params)
        parts.append(rule if prop in required else f"{rule}?")
    rule = f"call{index}"
    body = " ".join([_lit(f'<｜DSML｜invoke name="{name}">\n'), *parts, _lit("</｜DSML｜invoke>\n")])
    rules.append(f"{rule}: {body}")
    return rule


def tool_call_grammar(tools: Sequence[tuple[str, Any]], mode: str, parallel: bool = True) -> str:
    """A Lark grammar (llguidance's dialect) of DeepSeek tool calls of `tools` ((name, parameters JSON Schema)
    pairs: the tools a call may name) in `mode` (TOOL_MODES); `parallel`: more than one call per block."""
    if mode not in TOOL_MODES:
        raise ValueError(f"unknown tool-call grammar mode {mode!r}; expected one of {TOOL_MODES}")
    if not tools:
        raise ValueError("a tool-call grammar needs at least one tool")
    rules: list[str] = []
    calls = [_invoke(rules, i, name, params) for i, (name, params) in enumerate(tools)]
    rules.append(f"call: {' | '.join(calls)}")
    rules.append(f"calls: call{'+' if parallel else ''} {_lit(CLOSE)}")
    if mode == "opened":
        start = "start: calls"
    elif mode == "required":
        start = f"start: {_lit(chr(10) * 2 + OPEN)} calls"
    else:  # text with no DSML markup, or text and then a call block (opened by a lazy lexeme)
        start = "start: FREE | lead calls"
        rules.append("FREE: /(?s:.*)/ & ~/(?s:.*)｜DSML｜(?s:.*)/")
        rules.append(f"lead[lazy]: /(?s:.*)/ {_lit(OPEN)}")
    return "\n".join([start, *rules]) + "\n"
