"""The output constraint a request body asks for (structured outputs, issue #19): vLLM's `structured_outputs`
object or OpenAI's `response_format`, on the routes that honour them."""

from __future__ import annotations

from deepinfer_core.errors import RequestError
from deepinfer_core.serve.errors import ApiError
from deepinfer_core.structured.params import StructuredOutputsParams

__all__ = ["STRUCTURED_ROUTES", "structured_outputs_from_body"]

STRUCTURED_ROUTES = ("chat", "completions")
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")


def structured_outputs_from_body(body: dict, route: str) -> StructuredOutputsParams | None:
    """The output constraint a chat / completions body asks for: vLLM's `structured_outputs` object, or OpenAI's
    `response_format` (json_object; json_schema with the request's own schema, `$defs` and all); None for text.
    A malformed one is a 400 naming the field."""
    if route not in STRUCTURED_ROUTES:
        return None
    wanted, field = None, "structured_outputs"
    given = body.get("structured_outputs")
    if given is not None:
        if not isinstance(given, dict):
            raise ApiError(400, 'structured_outputs must be an object such as {"json": SCHEMA}', param=field)
        if unknown := sorted(set(given) - set(_STRUCTURED_KEYS)):
            message = f"structured_outputs has unknown keys {unknown}; it takes {', '.join(_STRUCTURED_KEYS)}"
            raise ApiError(400, message, param=field)
        wanted = dict(given)
    form = body.get("response_format")
    if form is not None and not (isinstance(form, dict) and form.get("type") == "text"):
        field = "response_format"
        if wanted is not None:
            raise ApiError(400, "give either response_format or structured_outputs, not both", param=field)
        kind = form.get("type") if isinstance(form, dict) else None
        if kind == "json_object":
            wanted = {"json_object": True}
        elif kind == "json_schema":
            spec = form.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ApiError(400, "response_format.json_schema.schema must be a JSON Schema object", param=field)
            wanted = {"json": schema}
        else:
            message = f"response_format.type must be text, json_object or json_schema, got {kind!r}"
            raise ApiError(400, message, param=field)
    if wanted is None:
        return None
    try:
        return StructuredOutputsParams(**wanted)
    except RequestError as err:
        raise ApiError(400, str(err), param=field) from None
