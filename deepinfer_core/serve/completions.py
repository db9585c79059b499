"""OpenAI's legacy Completions (`/v1/completions`) as vLLM serves it: raw text or token ids in (one prompt
or a list of them), text out, no chat template.

n samples per prompt (best_of: draw more, keep the n of highest cumulative logprob), echo (the prompt
before the text; with logprobs, the prompt tokens' logprobs too; with max_tokens 0, only the prompt),
vLLM's sampling extras through fields.py, and streaming that never sends part of a stop string.
Choice i of the response is sample i % n of prompt i // n. Requests are parsed and encoded in a worker
thread (prompt_encoding.py says why).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from deepinfer_core.engine.request import RequestOutput
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.serve import fields
from deepinfer_core.serve.completion_choices import ChoiceStream, Prompt, final_choice, usage
from deepinfer_core.serve.errors import ApiError
from deepinfer_core.serve.prompt_encoding import check_prompt_fits
from deepinfer_core.serve.state import ServerState
from deepinfer_core.serve.structured_fields import check_compiles, constraint_field

__all__ = ["run_completions"]

ROUTE = "completions"
DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for this route


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompts: list[Prompt]
    params: list[SamplingParams]  # one per prompt (max_tokens may differ: what the context leaves)
    echo: bool
    echo_only: bool  # echo with max_tokens 0: the prompt is the whole answer
    logprobs: int | None
    tokens_as_ids: bool  # vLLM's return_tokens_as_token_ids: "token_id:123" instead of the token's text
    stream: bool
    include_usage: bool
    continuous_usage: bool  # vLLM's stream_options.continuous_usage_stats: usage in every chunk


def _flag(body: dict, field: str) -> bool:
    value = body.get(field)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"invalid value for {field}: expected true or false, got {value!r}", param=field)
    return value


def _prompts(state: ServerState, value) -> list[Prompt]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""

    def bad(what: str) -> ApiError:
        return ApiError(
            400,
            f"invalid value for prompt: {what}; expected a string, a list of strings, a list of token ids "
            "or a list of token-id lists",
            param="prompt",
        )

    def is_id(t) -> bool:
        return isinstance(t, int) and not isinstance(t, bool)

    if isinstance(value, str):
        items = [value]
    elif isinstance(value, list) and value and all(is_id(t) for t in value):
        items = [value]
    elif isinstance(value, list) and value:
        if not (all(isinstance(v, str) for v in value) or all(isinstance(v, list) for v in value)):
            raise bad("a list mixes kinds of prompts")
        items = value
    elif isinstance(value, list):
        raise bad("the list is empty")
    else:
        raise bad(f"got {type(value).__name__}")
    for item in items:
        if isinstance(item, str):
            check_prompt_fits(state, item, "prompt")
        elif not (isinstance(item, list) and all(is_id(t) for t in item)):
            raise bad(f"an item is {type(item).__name__}")
        elif any(t < 0 for t in item):
            raise bad(f"token id {min(item)} is negative")
    encoded = iter(state.tokenizer.encode_many([item for item in items if isinstance(item, str)]))
    prompts = [Prompt(next(encoded), item) if isinstance(item, str) else Prompt(list(item), None) for item in items]
    if any(not prompt.token_ids for prompt in prompts):
        raise ApiError(400, "the prompt is empty", param="prompt")
    return prompts


def parse(state: ServerState, body: dict) -> CompletionRequest:
    model = body.get("model", state.served_model_name)  # optional in vLLM: the served model
    if model != state.served_model_name:
        raise ApiError(
            404,
            f"The model `{model}` does not exist; this server serves `{state.served_model_name}`.",
            param="model",
            code="model_not_found",
        )
    fields.refuse_unsupported(body, ROUTE)
    fields.check_sampling_fields(body, ROUTE)
    prompts = _prompts(state, body.get("prompt"))
    echo, stream = _flag(body, "echo"), _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "invalid value for stream_options: expected an object", param="stream_options")
    if options and not stream:
        raise ApiError(400, "stream_options can only be given with stream: true", param="stream_options")
    options = options or {}
    echo_only = echo and type(body.get("max_tokens")) is int and body["max_tokens"] == 0
    sampling = {k: v for k, v in body.items() if not (echo_only and k == "max_tokens")}
    requested, length_field = fields.requested_max_tokens(sampling, ROUTE, max_model_len=state.max_model_len)
    requested = 1 if echo_only else requested  # a prompt's logprobs come with one generated token, dropped
    params = [
        fields.sampling_params_from_body(
            body,
            route=ROUTE,
            max_tokens=fields.resolve_max_tokens(
                requested,
                length_field,
                prompt_len=len(prompt.token_ids),
                max_model_len=state.max_model_len,
                default_max_tokens=DEFAULT_MAX_TOKENS,
            ),
        )
        for prompt in prompts
    ]
    logprobs = params[0].logprobs
    if echo and logprobs is not None and params[0].prompt_logprobs is None:
        params = [replace(p, prompt_logprobs=logprobs) for p in params]  # vLLM: echo gives the prompt's too
    first = params[0]
    if stream and first.best_of is not None and first.best_of > first.n:
        raise ApiError(
            400, "best_of > n cannot be streamed: the best samples are known only at the end", param="best_of"
        )
    return CompletionRequest(
        model=model,
        prompts=prompts,
        params=params,
        echo=echo,
        echo_only=echo_only,
        logprobs=logprobs,
        tokens_as_ids=_flag(body, "return_tokens_as_token_ids"),
        stream=stream,
        include_usage=_flag(options, "include_usage"),
        continuous_usage=_flag(options, "continuous_usage_stats"),
    )


async def _start(state: ServerState, request_id: str, request: CompletionRequest):
    """Submit every prompt; -> one output iterator per prompt, each at its first output. Refusals (overload,
    a prompt the engine rejects) raise here, before any byte of the answer is sent."""
    generators = [
        state.engine.generate(f"{request_id}-{i}", prompt.token_ids, params)
        for i, (prompt, params) in enumerate(zip(request.prompts, request.params))
    ]
    firsts = await asyncio.gather(*(anext(g) for g in generators), return_exceptions=True)
    failed = next((f for f in firsts if isinstance(f, BaseException)), None)
    if failed is not None:
        for generator in generators:
            await generator.aclose()
        raise failed

    async def outputs(first: RequestOutput, rest) -> AsyncIterator[RequestOutput]:
        try:
            yield first
            async for output in rest:
                yield output
        finally:  # a client that went away: abort now, not when the generator is collected
            await rest.aclose()

    return [outputs(first, g) for first, g in zip(firsts, generators)]


async def _merged(iterators: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from all prompts' iterators as they come; leaving early closes them all."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, iterator) -> None:
        try:
            async for output in iterator:
                queue.put_nowait((i, output))
            queue.put_nowait((i, None))
        except Exception as err:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((i, err))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_completions(state: ServerState, body: dict):
    """-> ("stream", SSE text iterator) or ("json", body text). Raises ApiError."""
    request = await asyncio.to_thread(parse, state, body)
    for wanted in {p.structured_outputs for p in request.params}:  # one constraint for every prompt
        await check_compiles(state.engine, wanted, constraint_field(body, "completions"))
    request_id, created = "cmpl-" + uuid.uuid4().hex, int(time.time())
    iterators = await _start(state, request_id, request)

    def envelope(choices: list[dict], usage_body: dict | None = None) -> dict:
        out = {"id": request_id, "object": "text_completion", "created": created, "model": request.model}
        out["choices"] = choices
        if usage_body is not None:
            out["usage"] = usage_body
        return out

    if request.stream:
        return "stream", _sse(state, request, iterators, envelope)
    finals: list[RequestOutput | None] = [None] * len(iterators)
    prompt_logprobs: list = [None] * len(iterators)
    merged = _merged(iterators)
    try:
        async for i, output in merged:
            finals[i] = output
            prompt_logprobs[i] = prompt_logprobs[i] or output.prompt_logprobs
    finally:
        await merged.aclose()
    choices = [
        final_choice(state, request, request.prompts[i], prompt_logprobs[i], sample, i * request.params[i].n)
        for i, output in enumerate(finals)
        for sample in output.outputs
    ]
    counted = usage(request, finals)
    return "json", json.dumps(envelope(choices, counted))


async def _sse(state: ServerState, request: CompletionRequest, iterators, envelope) -> AsyncIterator[str]:
    streams = [ChoiceStream(state, request, prompt) for prompt in request.prompts]
    latest: list[RequestOutput | None] = [None] * len(iterators)
    merged = _merged(iterators)
    try:
        async for i, output in merged:
            latest[i] = output
            choices = streams[i].chunks(output, base_index=i * request.params[i].n)
            if choices:
                running = (
                    usage(request, latest, streams) if request.include_usage and request.continuous_usage else None
                )
                yield f"data: {json.dumps(envelope(choices, running))}\n\n"
    finally:
        await merged.aclose()
    if request.include_usage:
        yield f"data: {json.dumps(envelope([], usage(request, latest, streams)))}\n\n"
    yield "data: [DONE]\n\n"
