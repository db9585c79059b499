"""The FastAPI application: routes, access control, body limits, and errors in each protocol's format.

Bad input never reaches a 500: bodies are parsed here (JSON content type only, malformed JSON, oversize)
and every refusal is an ApiError answered in the caller's protocol; a stream that cannot finish ends
with its protocol's error event. Routes as vLLM spells them: the /v1 protocols and models, /tokenize,
/detokenize, /version, /health, /ping, /metrics, plus Anthropic's /v1/messages/count_tokens. As in vLLM,
--api-key guards the routes under /v1 only; the others (tokenizer, version, health, metrics) stay open.
Every response carries an `x-request-id` (the client's, else a new one); CORS headers only with
--allowed-origins.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from deepinfer_core import __version__
from deepinfer_core.engine.engine import RequestError
from deepinfer_core.serve import request_log
from deepinfer_core.serve.async_engine import EngineFailure, Overloaded, ShuttingDown
from deepinfer_core.serve.completions import run_completions
from deepinfer_core.serve.errors import ApiError, error_response, stream_error_event
from deepinfer_core.serve.http_protocol import READ_TIMED_OUT
from deepinfer_core.serve.protocols import PROTOCOLS, run_protocol
from deepinfer_core.serve.state import ServerState
from deepinfer_core.serve.tokenize import run_count_tokens, run_detokenize, run_tokenize

__all__ = ["CorsPolicy", "build_app"]

log = logging.getLogger(__name__)
_ANTHROPIC_PATHS = ("/v1/messages",)
_REQUEST_ID_HEADER = b"x-request-id"
_MAX_REQUEST_ID = 256  # characters of a client's x-request-id
_SHUTDOWN_MESSAGE = "the server is shutting down and its grace period (--shutdown-grace-period) ran out; retry"


@dataclass(frozen=True, slots=True)
class CorsPolicy:
    """--allowed-origins and friends (vLLM's flags); no policy: no CORS headers at all."""

    allowed_origins: tuple[str, ...]
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


def _is_anthropic(path: str) -> bool:
    return path.startswith(_ANTHROPIC_PATHS)


def _stream_style(path: str) -> str:
    return "anthropic" if _is_anthropic(path) else "responses" if path == "/v1/responses" else "openai"


def _bearer(header: str) -> str:
    """The token of an `Authorization: Bearer <token>` header (the scheme is case-insensitive), else ""."""
    scheme, _, token = header.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _check_key(state: ServerState, request: Request) -> None:
    if state.api_key is None or not request.url.path.startswith("/v1"):  # vLLM guards /v1 only
        return
    given = _bearer(request.headers.get("authorization", ""))
    if _is_anthropic(request.url.path):
        given = request.headers.get("x-api-key") or given
    if not hmac.compare_digest(given.encode(), state.api_key.encode()):
        header = "x-api-key" if _is_anthropic(request.url.path) else "Authorization: Bearer"
        raise ApiError(401, f"invalid or missing API key: send it in the {header} header", code="invalid_api_key")


def _check_json_type(request: Request) -> None:
    """JSON bodies only: a form or text/plain post (which any web page can send without asking, even to a
    server without a key) is refused before it is read."""
    given = request.headers.get("content-type")
    media = (given or "").partition(";")[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    what = f"Content-Type {given!r}" if given else "a request without a Content-Type"
    raise ApiError(415, f"{what} is not supported: send a JSON body with the header 'Content-Type: application/json'")


async def _json_body(state: ServerState, request: Request) -> dict:
    _check_json_type(request)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > state.max_body_bytes:
        raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {state.max_body_bytes} bytes")
    raw = b""
    try:
        async for part in request.stream():
            raw += part
            if len(raw) > state.max_body_bytes:
                raise ApiError(413, f"request body exceeds the limit of {state.max_body_bytes} bytes")
    except ClientDisconnect:
        if request.scope.get(READ_TIMED_OUT):
            raise ApiError(408, "the request body stopped arriving (--timeout-request-body)") from None
        raise ApiError(499, "the client closed the connection while sending the request body") from None
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if b"\\u" in raw:  # an escaped lone surrogate (\ud800) parses, but is no text: it breaks encoders later
        try:
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise ApiError(400, "the request body is not valid JSON: a \\u escape is a lone surrogate") from None
        except RecursionError:
            raise ApiError(400, "the request body is nested too deeply") from None
    return body


async def _unless_disconnected(request: Request, work):
    """Await `work`; if the client goes away first, cancel it (which aborts its engine request)."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ApiError(499, "client closed the request")


def _as_api_error(err: Exception, endpoint: str) -> ApiError:
    """The answer to an exception raised while serving a request (call it in the `except` clause)."""
    if isinstance(err, ApiError):
        return err
    if isinstance(err, Overloaded):
        return ApiError(503, str(err), headers={"Retry-After": "1"})
    if isinstance(err, ShuttingDown):
        return ApiError(503, _SHUTDOWN_MESSAGE, code="server_shutting_down")
    if isinstance(err, RequestError):  # the engine refused it (too long, bad token ids)
        return ApiError(400, str(err))
    if isinstance(err, EngineFailure):
        return ApiError(500, str(err))
    log.exception("unexpected error on %s", endpoint)  # a bug of ours: answer in format, keep serving
    return ApiError(500, "internal server error; see the server log")


async def _logged_stream(
    payload: AsyncIterator[str], record: request_log.RequestRecord, endpoint: str, style: str
) -> AsyncIterator[str]:
    """The streamed answer, then its request-log line: 499 when the client left before the end; a stream
    that fails (shutdown, engine failure) ends with the protocol's error event and that error's status."""
    status, events = 499, 0
    try:
        async for part in payload:
            events += part.count("\n\n")
            yield part
        status = 200
    except Exception as err:  # noqa: BLE001 - every failure becomes the error event
        answer = _as_api_error(err, endpoint)
        status = answer.status
        yield stream_error_event(answer, style, events)
    finally:
        await payload.aclose()
        request_log.log_finished(record, status)


class _RequestIds:
    """ASGI middleware: every HTTP response carries `x-request-id`, the client's (up to 256 visible ASCII
    characters; longer or odd ones are a 400) or a new one; the request log shows it."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == _REQUEST_ID_HEADER), None)
        if given is None:
            request_id = uuid.uuid4().hex
        elif 0 < len(given) <= _MAX_REQUEST_ID and all(0x21 <= c <= 0x7E for c in given):
            request_id = given.decode()
        else:
            err = ApiError(400, f"the x-request-id header must be 1 to {_MAX_REQUEST_ID} visible ASCII characters")
            return await error_response(err, _is_anthropic(scope["path"]))(scope, receive, send)
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (_REQUEST_ID_HEADER, request_id.encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)


def build_app(state: ServerState, cors: CorsPolicy | None = None) -> FastAPI:
    state.metrics.bind(state.served_model_name, state.max_model_len)
    if state.engine.metrics is None:
        state.engine.metrics = state.metrics

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        yield
        await state.engine.stop()

    app = FastAPI(title="DeepInfer", lifespan=lifespan)
    app.add_middleware(_RequestIds)
    if cors is not None and cors.allowed_origins:  # outermost: answers preflights before routing
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors.allowed_origins),
            allow_methods=list(cors.allowed_methods),
            allow_headers=list(cors.allowed_headers),
            allow_credentials=cors.allow_credentials,
            expose_headers=["x-request-id"],
        )

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError):
        return error_response(err, _is_anthropic(request.url.path))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):  # unknown path, wrong method
        message = f"{request.method} {request.url.path}: {err.detail}"
        if err.status_code == 405 and err.headers and "Allow" in err.headers:
            message += f"; this route takes {err.headers['Allow']}"
        answer = ApiError(err.status_code, message, headers=dict(err.headers or {}))
        return error_response(answer, _is_anthropic(request.url.path))

    def refused(endpoint: str, record: request_log.RequestRecord, status: int) -> None:
        state.metrics.requests.labels(endpoint, str(status)).inc()
        request_log.log_finished(record, status)

    async def handle(request: Request, endpoint: str, run) -> Response:
        record = request_log.open_record(endpoint, request.scope.get("state", {}).get("request_id"))
        try:
            _check_key(state, request)
            kind, payload = await _unless_disconnected(request, run(state, await _json_body(state, request)))
        except Exception as err:  # noqa: BLE001 - answered in the protocol's format; the server keeps serving
            answer = _as_api_error(err, endpoint)
            refused(endpoint, record, answer.status)
            raise answer from None
        state.metrics.requests.labels(endpoint, "200").inc()
        if kind == "stream":
            return StreamingResponse(
                _logged_stream(payload, record, endpoint, _stream_style(request.url.path)),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        request_log.log_finished(record, 200)
        return Response(payload, media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, "chat_completions", lambda s, b: run_protocol(s, PROTOCOLS["chat"], b))

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await handle(request, "responses", lambda s, b: run_protocol(s, PROTOCOLS["responses"], b))

    @app.post("/v1/messages")
    async def messages(request: Request):
        return await handle(request, "messages", lambda s, b: run_protocol(s, PROTOCOLS["messages"], b))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):  # Anthropic's: the prompt tokens /v1/messages would feed the model
        return await handle(request, "count_tokens", run_count_tokens)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completions", run_completions)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await handle(request, "tokenize", run_tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await handle(request, "detokenize", run_detokenize)

    started = int(time.time())

    def card() -> dict:  # vLLM's ModelCard
        permission = {
            "id": "modelperm-" + uuid.uuid4().hex,
            "object": "model_permission",
            "created": started,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        return {
            "id": state.served_model_name,
            "object": "model",
            "created": started,
            "owned_by": "deepinfer",
            "root": state.served_model_name,
            "parent": None,
            "max_model_len": state.max_model_len,
            "permission": [permission],
        }

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(request: Request):
        _check_key(state, request)
        return JSONResponse({"object": "list", "data": [card()]})

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(request: Request, model_id: str):
        _check_key(state, request)
        if model_id != state.served_model_name:
            message = f"The model `{model_id}` does not exist; this server serves `{state.served_model_name}`."
            raise ApiError(404, message, param="model", code="model_not_found")
        return JSONResponse(card())

    @app.api_route("/version", methods=["GET", "HEAD"])
    async def version():
        return {"version": __version__}

    def status() -> Response:
        if state.engine.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "error", "detail": "the engine loop has stopped; restart the server"}, 503)

    @app.api_route("/health", methods=["GET", "HEAD"])  # load balancers probe with HEAD
    async def health():
        return status()

    @app.api_route("/ping", methods=["GET", "HEAD", "POST"])
    async def ping():  # SageMaker's health check, as vLLM serves it
        return status()

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics():
        state.metrics.observe_engine(state.engine.engine)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
