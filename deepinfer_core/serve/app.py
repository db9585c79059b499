"""The FastAPI application: routes, access control, body limits, and errors in each protocol's format.

Bad input never reaches a 500: bodies are parsed here (malformed JSON, oversize) and every refusal is
an ApiError answered in the caller's protocol.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepinfer_core.engine.engine import RequestError
from deepinfer_core.serve.async_engine import EngineFailure, Overloaded
from deepinfer_core.serve.completions import run_completions
from deepinfer_core.serve.errors import ApiError, error_response
from deepinfer_core.serve.protocols import PROTOCOLS, run_protocol
from deepinfer_core.serve.state import ServerState

__all__ = ["build_app"]

log = logging.getLogger(__name__)
_ANTHROPIC_PATHS = ("/v1/messages",)


def _is_anthropic(request: Request) -> bool:
    return request.url.path.startswith(_ANTHROPIC_PATHS)


def _check_key(state: ServerState, request: Request) -> None:
    if state.api_key is None:
        return
    if _is_anthropic(request):
        given = request.headers.get("x-api-key") or ""
        if not given and request.headers.get("authorization", "").startswith("Bearer "):
            given = request.headers["authorization"].removeprefix("Bearer ")
    else:
        header = request.headers.get("authorization", "")
        given = header[len("Bearer ") :] if header.startswith("Bearer ") else ""
    if not hmac.compare_digest(given.encode(), state.api_key.encode()):
        header = "x-api-key" if _is_anthropic(request) else "Authorization: Bearer"
        raise ApiError(401, f"invalid or missing API key: send it in the {header} header", code="invalid_api_key")


async def _json_body(state: ServerState, request: Request) -> dict:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > state.max_body_bytes:
        raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {state.max_body_bytes} bytes")
    raw = b""
    async for part in request.stream():
        raw += part
        if len(raw) > state.max_body_bytes:
            raise ApiError(413, f"request body exceeds the limit of {state.max_body_bytes} bytes")
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


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        yield
        await state.engine.stop()

    app = FastAPI(title="DeepInfer", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError):
        return error_response(err, _is_anthropic(request))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):  # unknown path, wrong method
        message = f"{request.method} {request.url.path}: {err.detail}"
        return error_response(ApiError(err.status_code, message), _is_anthropic(request))

    async def handle(request: Request, endpoint: str, run) -> Response:
        try:
            _check_key(state, request)
            kind, payload = await _unless_disconnected(request, run(state, await _json_body(state, request)))
        except ApiError as err:
            state.metrics.requests.labels(endpoint, str(err.status)).inc()
            raise
        except Overloaded as err:
            state.metrics.requests.labels(endpoint, "503").inc()
            raise ApiError(503, str(err), headers={"Retry-After": "1"}) from None
        except RequestError as err:  # the engine refused it (too long, bad token ids)
            state.metrics.requests.labels(endpoint, "400").inc()
            raise ApiError(400, str(err)) from None
        except EngineFailure as err:
            state.metrics.requests.labels(endpoint, "500").inc()
            raise ApiError(500, str(err)) from None
        except Exception:  # a bug of ours: answer in the protocol's format and keep serving
            log.exception("unexpected error on %s", endpoint)
            state.metrics.requests.labels(endpoint, "500").inc()
            raise ApiError(500, "internal server error; see the server log") from None
        state.metrics.requests.labels(endpoint, "200").inc()
        if kind == "stream":
            return StreamingResponse(
                payload,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
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

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completions", run_completions)

    @app.get("/v1/models")
    async def models(request: Request):
        _check_key(state, request)
        card = {
            "id": state.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "deepinfer",
            "max_model_len": state.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        state.metrics.observe_engine(state.engine.engine)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
