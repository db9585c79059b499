"""OpenAI's legacy Completions (`/v1/completions`): raw text (or token ids) in, text out, no chat template.

deepseek-recipe covers the chat-style protocols; this one is small enough to be plain code here.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deepinfer_core.errors import DeepInferError
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.serve.errors import ApiError
from deepinfer_core.serve.state import ServerState

__all__ = ["run_completions"]


class StreamOptions(BaseModel):
    include_usage: bool = False


class CompletionBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    prompt: str | list[int] | list[str]
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # vLLM's extension
    min_p: float = Field(0.0, ge=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    n: int = Field(1, ge=1, le=1)
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None


def _parse(state: ServerState, body: dict) -> tuple[CompletionBody, list[int], SamplingParams]:
    try:
        request = CompletionBody.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "body"
        raise ApiError(400, f"invalid value for {field}: {first['msg']}", param=field) from None
    if request.model != state.served_model_name:
        raise ApiError(
            404,
            f"The model `{request.model}` does not exist; this server serves `{state.served_model_name}`.",
            param="model",
            code="model_not_found",
        )
    if request.echo:
        raise ApiError(400, "echo is not supported", param="echo")
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise ApiError(400, "only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    ids = state.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if len(ids) + request.max_tokens > state.max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {state.max_model_len} tokens. However, you "
            f"requested {len(ids) + request.max_tokens} tokens ({len(ids)} in the prompt, "
            f"{request.max_tokens} in the completion).",
            param="max_tokens",
        )
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    try:
        params = SamplingParams(
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            min_p=request.min_p,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            seed=request.seed,
            max_tokens=request.max_tokens,
            stop=stop,
            logprobs=request.logprobs,
        )
    except ValueError as err:  # what the body's schema lets through (an empty stop string, a seed >= 2**64)
        raise ApiError(400, str(err)) from None
    return request, ids, params


def _logprobs(state: ServerState, output) -> dict | None:
    completion = output.outputs[0]
    if completion.token_logprobs is None:
        return None
    token = output.new_token_ids[0]
    decode = state.tokenizer.decode
    return {
        "tokens": [decode([token])],
        "token_logprobs": [completion.token_logprobs[-1]],
        "top_logprobs": [{decode([t]): lp for t, lp in completion.top_logprobs[-1].items()}],
        "text_offset": [len(completion.text) - len(output.new_text)],
    }


async def run_completions(state: ServerState, body: dict):
    """-> ("stream", SSE text iterator) or ("json", body text). Raises ApiError."""
    request, ids, params = _parse(state, body)
    request_id, created = "cmpl-" + uuid.uuid4().hex, int(time.time())

    def chunk(text: str, finish: str | None, logprobs=None, usage=None) -> dict:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        out = {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": request.model,
            "choices": [choice],
        }
        if usage is not None:
            out["usage"] = usage
        return out

    outputs = state.engine.generate(request_id, ids, params)
    try:
        first = await anext(outputs)
    except DeepInferError:
        await outputs.aclose()
        raise

    async def all_outputs():
        try:
            yield first
            async for output in outputs:
                yield output
        finally:  # a client that went away: abort now, not when the generator is collected
            await outputs.aclose()

    def usage_of(output) -> dict:
        generated = len(output.outputs[0].token_ids)
        return {
            "prompt_tokens": len(ids),
            "completion_tokens": generated,
            "total_tokens": len(ids) + generated,
            "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens},
        }

    if request.stream:

        async def sse() -> AsyncIterator[str]:
            last = None
            async for output in all_outputs():
                last = output
                finish = output.outputs[0].finish_reason if output.finished else None
                yield f"data: {json.dumps(chunk(output.new_text, finish, _logprobs(state, output)))}\n\n"
            if request.stream_options and request.stream_options.include_usage and last is not None:
                body = {**chunk("", None), "choices": [], "usage": usage_of(last)}
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"

        return "stream", sse()
    last, merged = None, {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    async for output in all_outputs():
        last = output
        if (lp := _logprobs(state, output)) is not None:
            for key in merged:
                merged[key] += lp[key]
    completion = last.outputs[0]
    logprobs = merged if completion.token_logprobs is not None else None
    return "json", json.dumps(chunk(completion.text, completion.finish_reason, logprobs, usage_of(last)))
