"""Errors in each protocol's own format: OpenAI's {"error": {...}} and Anthropic's {"type": "error", ...}."""

from __future__ import annotations

import json
import re

from fastapi.responses import JSONResponse

__all__ = ["ApiError", "error_response", "from_conversion_error", "invalid_body", "stream_error_event"]

# OpenAI error type by status, and Anthropic's
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_overloaded",
    500: "internal_server_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    500: "api_error",
}


class ApiError(Exception):
    """An error to answer with: HTTP status, a message for people, and optionally the offending param."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


def _anthropic_body(err: ApiError) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(err.status, "api_error"), "message": err.message}}


def _openai_error(err: ApiError) -> dict:
    kind = _OPENAI_TYPES.get(err.status, "invalid_request_error")
    return {"message": err.message, "type": kind, "param": err.param, "code": err.code or kind}


def error_response(err: ApiError, anthropic: bool) -> JSONResponse:
    body = _anthropic_body(err) if anthropic else {"error": _openai_error(err)}
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def stream_error_event(err: ApiError, style: str, events_sent: int) -> str:
    """The last server-sent event of a stream that cannot finish (the shutdown grace ran out, the engine
    failed), in the protocol's format: `style` is "openai" (chat, completions: an error object, then
    [DONE], as vLLM sends), "responses" (an `error` event with the next sequence number) or "anthropic"
    (an `error` event, as Anthropic's API sends)."""
    if style == "anthropic":
        return f"event: error\ndata: {json.dumps(_anthropic_body(err))}\n\n"
    error = _openai_error(err)
    if style == "responses":
        event = {"type": "error", "code": error["code"], "message": err.message, "param": err.param}
        return f"event: error\ndata: {json.dumps({**event, 'sequence_number': events_sent})}\n\n"
    return f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n"


_NAMED_FIELD = re.compile(r"^Invalid (\w+) value")  # deepseek-recipe's "Invalid temperature value, ..."
_BODY_PREFIX = "invalid request body: "


def from_conversion_error(err) -> ApiError:
    """deepseek-recipe's ConversionError carries a status and an OpenAI-format body: keep its message,
    and name the field when the message does."""
    try:
        error = json.loads(err.body)["error"]
        message, param = error["message"], error.get("param")
    except (TypeError, ValueError, KeyError, AttributeError):
        message, param = str(err), None
    if param is None and (named := _NAMED_FIELD.match(message)):
        param = named.group(1)
    return ApiError(int(getattr(err, "status_code", 400) or 400), message, param=param)


def invalid_body(err: Exception) -> ApiError:
    """A body the protocol's request parser refused (wrong types, integers too big); its message may
    already say "invalid request body" (deepseek-recipe's do): say it once."""
    message = str(err)
    return ApiError(400, message if message.startswith(_BODY_PREFIX) else _BODY_PREFIX + message)
