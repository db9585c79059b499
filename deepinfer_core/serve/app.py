"""The FastAPI application: routes, access control, body limits, and errors in each protocol's format.

Bad input never reaches a 500: bodies are parsed here (malformed JSON, oversize) and every refusal is
an ApiError answered in the caller's protocol. Routes as vLLM spells them: the /v1 protocols and
models, /tokenize, /detokenize, /version, /health, /ping, /metrics. As in vLLM, --api-key guards the
routes under /v1 only; the others (tokenizer, version, health, metrics) stay open.
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

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepinfer_core import __version__
from deepinfer_core.engine.engine import RequestError
from deepinfer_core.serve import request_log
from deepinfer_core.serve.async_engine import EngineFailure, Overloaded
from deepinfer_core.serve.completions import run_completions
from deepinfer_core.serve.errors import ApiError, error_response
from deepinfer_core.serve.protocols import PROTOCOLS, run_protocol
from deepinfer_core.serve.state import ServerState
from deepinfer_core.serve.tokenize import run_detokenize, run_tokenize

__all__ = ["build_app"]

log = logging.getLogger(__name__)
_ANTHROPIC_PATHS = ("/v1/messages",)


def _is_anthropic(request: Request) -> bool:
    return request.url.path.startswith(_ANTHROPIC_PATHS)


def _check_key(state: ServerState, request: Request) -> None:
    if state.api_key is None or not request.url.path.startswith("/v1"):  # vLLM guards /v1 only
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


async def _logged_stream(payload: AsyncIterator[str], record: request_log.RequestRecord) -> AsyncIterator[str]:
    """The streamed answer, then its request-log line (status 499 when the client left before the end)."""
    completed = False
    try:
        async for part in payload:
            yield part
        completed = True
    finally:
        await payload.aclose()
        request_log.log_finished(record, 200 if completed else 499)


def build_app(state: ServerState) -> FastAPI:
    state.metrics.bind(state.served_model_name, state.max_model_len)
    if state.engine.metrics is None:
        state.engine.metrics = state.metrics

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

    def refused(endpoint: str, record: request_log.RequestRecord, status: int) -> None:
        state.metrics.requests.labels(endpoint, str(status)).inc()
        request_log.log_finished(record, status)

    async def handle(request: Request, endpoint: str, run) -> Response:
        record = request_log.open_record(endpoint)
        try:
            _check_key(state, request)
            kind, payload = await _unless_disconnected(request, run(state, await _json_body(state, request)))
        except ApiError as err:
            refused(endpoint, record, err.status)
            raise
        except Overloaded as err:
            refused(endpoint, record, 503)
            raise ApiError(503, str(err), headers={"Retry-After": "1"}) from None
        except RequestError as err:  # the engine refused it (too long, bad token ids)
            refused(endpoint, record, 400)
            raise ApiError(400, str(err)) from None
        except EngineFailure as err:
            refused(endpoint, record, 500)
            raise ApiError(500, str(err)) from None
        except Exception:  # a bug of ours: answer in the protocol's format and keep serving
            log.exception("unexpected error on %s", endpoint)
            refused(endpoint, record, 500)
            raise ApiError(500, "internal server error; see the server log") from None
        state.metrics.requests.labels(endpoint, "200").inc()
        if kind == "stream":
            return StreamingResponse(
                _logged_stream(payload, record),
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

    @app.get("/v1/models")
    async def models(request: Request):
        _check_key(state, request)
        return JSONResponse({"object": "list", "data": [card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        _check_key(state, request)
        if model_id != state.served_model_name:
            message = f"The model `{model_id}` does not exist; this server serves `{state.served_model_name}`."
            raise ApiError(404, message, param="model", code="model_not_found")
        return JSONResponse(card())

    @app.get("/version")
    async def version():
        return {"version": __version__}

    def status() -> Response:
        if state.engine.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "error", "detail": "the engine loop has stopped; restart the server"}, 503)

    @app.get("/health")
    async def health():
        return status()

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():  # SageMaker's health check, as vLLM serves it
        return status()

    @app.get("/metrics")
    async def metrics():
        state.metrics.observe_engine(state.engine.engine)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
