"""What a request asks its output to follow: vLLM's `StructuredOutputsParams` (one of json, regex, choice,
grammar, json_object)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from deepinfer_core.errors import RequestError

__all__ = ["StructuredOutputsParams"]

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of:

    json: a JSON Schema (a dict, or its JSON text); the output is one JSON value it accepts.
    regex: the output matches this regular expression (Rust `regex` syntax, whole output).
    choice: the output is one of these strings.
    grammar: a Lark or GBNF (llama.cpp) grammar of the whole output.
    json_object: True: any JSON object.

    disable_any_whitespace (default True, vLLM's option of that name, default False there): JSON comes out compact,
    no whitespace between tokens, because a weak model allowed free whitespace can spend its whole budget on it;
    False lets the model place whitespace where JSON allows it.

    reasoning_end_token_id: set by the server for a reasoning (thinking-mode) request: the output is free text up
    to this token (the end of thinking), and the constraint holds after it; None: from the first token."""

    json: Mapping[str, Any] | str | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    reasoning_end_token_id: int | None = None

    def __post_init__(self) -> None:
        given = [kind for kind in _KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            named = ", ".join(given) if given else "none"
            raise RequestError(
                f"structured outputs take exactly one of {', '.join(_KINDS)}; got {named}: give one constraint"
            )
        if self.json is not None and not isinstance(self.json, (str, Mapping)):
            raise RequestError(f"structured outputs' json must be a JSON Schema object or its text, got {self.json!r}")
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as err:
                raise RequestError(f"structured outputs' json is not valid JSON: {err}") from None
            if not isinstance(schema, (dict, bool)):
                raise RequestError("structured outputs' json must be a JSON Schema: an object (or true / false)")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice) or not self.choice:
                raise RequestError("structured outputs' choice must be a non-empty list of strings")
        end = self.reasoning_end_token_id
        if end is not None and (not isinstance(end, int) or isinstance(end, bool) or end < 0):
            raise RequestError(f"structured outputs' reasoning_end_token_id must be a token id, got {end!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise RequestError(f"structured outputs' {name} must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(kind for kind in _KINDS if getattr(self, kind) not in (None, False))

    def key(self) -> tuple[str, str, bool, int | None]:
        """A hashable identity: (kind, canonical text, compact, reasoning end) — requests with equal keys share a
        grammar."""
        kind = self.kind
        if kind == "json":
            text = json.dumps(json.loads(self.json) if isinstance(self.json, str) else self.json, sort_keys=True)
        elif kind == "choice":
            text = json.dumps(list(self.choice))
        elif kind == "json_object":
            text = ""
        else:
            text = getattr(self, kind)
        return kind, text, self.disable_any_whitespace, self.reasoning_end_token_id
