"""Checks a request's `tool_choice` against its `tools`: it must name a tool of `tools`, and cannot ask for a
tool call without tools."""

from __future__ import annotations

from typing import Any

from deepinfer_core.serve.errors import ApiError

__all__ = ["check_tool_choice"]

# per route: the tool_choice values that ask for some tool call, and how a tool_choice naming one tool and
# a tool of `tools` spell its name (chat nests it under "function"; a Messages tool of any type has one)
_CALL_REQUIRED = {"chat": ("required",), "responses": ("required",), "messages": ("any",)}
_NAMED_TYPE = {"chat": "function", "responses": "function", "messages": "tool"}


def _function_name(entry: dict, route: str) -> Any:
    if route == "chat":
        function = entry.get("function")
        return function.get("name") if isinstance(function, dict) else None
    return entry.get("name")


def _tool_names(tools: list, route: str) -> set[str] | None:
    """The names of `tools`; None when a tool is of a form whose name is the converter's to judge (a
    Responses namespace or hosted tool, a chat custom tool, a malformed entry)."""
    names = set()
    for tool in tools:
        kind = tool.get("type", "function") if isinstance(tool, dict) else None
        name = _function_name(tool, route) if kind == "function" or route == "messages" else None
        if not isinstance(name, str):
            return None
        names.add(name)
    return names


def check_tool_choice(body: dict, route: str) -> None:
    """Raise a 400 naming tool_choice when it asks for a tool call without tools, or names a tool that is
    not in `tools` (as vLLM). Values of other shapes are the protocol parser's to refuse."""
    choice, tools = body.get("tool_choice"), body.get("tools") or []
    if route not in _CALL_REQUIRED or choice is None or not isinstance(tools, list):
        return
    kind = choice.get("type") if isinstance(choice, dict) else choice
    named = _function_name(choice, route) if isinstance(choice, dict) and kind == _NAMED_TYPE[route] else None
    if not tools and (named is not None or kind in _CALL_REQUIRED[route]):
        asked = f"the tool {named!r}" if named is not None else "a tool call"
        message = f"invalid value for tool_choice: it asks for {asked}, but the request has no tools; give tools"
        raise ApiError(400, message + " or leave tool_choice out", param="tool_choice")
    if isinstance(named, str) and (names := _tool_names(tools, route)) is not None and named not in names:
        message = f"invalid value for tool_choice: it names the tool {named!r}, which is not in tools"
        raise ApiError(400, f"{message} ({', '.join(sorted(names))})", param="tool_choice")
