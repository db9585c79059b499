"""Errors in each protocol's own format: OpenAI's {"error": {...}} and Anthropic's {"type": "error", ...}."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

__all__ = ["ApiError", "error_response"]

# OpenAI error type by status, and Anthropic's
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_overloaded",
    500: "internal_server_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
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


def error_response(err: ApiError, anthropic: bool) -> JSONResponse:
    if anthropic:
        body = {
            "type": "error",
            "error": {"type": _ANTHROPIC_TYPES.get(err.status, "api_error"), "message": err.message},
        }
    else:
        kind = _OPENAI_TYPES.get(err.status, "invalid_request_error")
        body = {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code or kind}}
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def from_conversion_error(err) -> ApiError:
    """deepseek-recipe's ConversionError carries a status and an OpenAI-format body: keep its message."""
    try:
        message = json.loads(err.body)["error"]["message"]
    except (TypeError, ValueError, KeyError):
        message = str(err)
    return ApiError(int(getattr(err, "status_code", 400) or 400), message)
