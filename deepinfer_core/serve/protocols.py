"""Chat Completions, Responses and Messages through deepseek-recipe: request conversion, prompt encoding,
and streaming output parsing are its job; ours is to run the tokens through the engine in between."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import deepseek_recipe as dr

from deepinfer_core.engine.request import RequestOutput
from deepinfer_core.errors import DeepInferError
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.serve.errors import ApiError, from_conversion_error
from deepinfer_core.serve.state import ServerState

__all__ = ["PROTOCOLS", "Protocol", "run_protocol"]


@dataclass(frozen=True)
class Protocol:
    name: str  # metrics label
    request_cls: type
    response_cls: type
    id_prefix: str
    anthropic: bool = False


PROTOCOLS = {
    "chat": Protocol("chat_completions", dr.ChatCompletionRequest, dr.ChatCompletionResponse, "chatcmpl-"),
    "responses": Protocol("responses", dr.ResponsesRequest, dr.ResponsesResponse, "resp_"),
    "messages": Protocol("messages", dr.MessagesRequest, dr.MessagesResponse, "msg_", anthropic=True),
}

_FINISH = {"stop": dr.InferenceFinishReason.Stop, "length": dr.InferenceFinishReason.Length}


@dataclass
class _Prepared:
    conv: dr.ConversationRequest
    generator: object
    prompt_ids: list[int]
    params: SamplingParams


def _prepare(state: ServerState, protocol: Protocol, body: dict, request_id: str) -> _Prepared:
    try:
        request = protocol.request_cls(body)
    except (ValueError, TypeError, OverflowError, RecursionError) as err:  # an integer too big, nesting too deep
        raise ApiError(400, f"invalid request body: {err}") from None
    if request.model != state.served_model_name:
        raise ApiError(
            404,
            f"The model `{request.model}` does not exist; this server serves `{state.served_model_name}`.",
            param="model",
            code="model_not_found",
        )
    extras = {}
    if protocol.request_cls is dr.ResponsesRequest:  # read before convert consumes the request
        extras = {"tools": request.namespace_tool_map(state.options), "echo": request.echo()}
    try:
        conv = request.convert(state.options)
        prompt_ids = state.encoding.encode(conv.conversation)
        max_tokens = conv.resolve_max_tokens(len(prompt_ids), state.max_model_len)
    except dr.ConversionError as err:
        raise from_conversion_error(err) from None
    if protocol.request_cls is dr.MessagesRequest:
        generator = dr.MessagesRequest.chunk_generator(conv, request_id, state.served_model_name)
    else:
        generator = protocol.request_cls.chunk_generator(conv, request_id, state.served_model_name)
    if extras:
        generator = generator.with_namespace_tool_map(extras["tools"]).with_echo(extras["echo"])
    options = conv.inference_options
    try:
        params = SamplingParams(
            temperature=1.0 if options.temperature is None else options.temperature,
            top_p=1.0 if options.top_p is None else options.top_p,
            seed=options.seed,
            max_tokens=max_tokens,
            stop=tuple(conv.parsing_options.stop_sequences),
            logprobs=(options.top_logprobs or 0) if options.logprobs else None,
        )
    except ValueError as err:
        raise ApiError(400, str(err)) from None
    return _Prepared(conv, generator, prompt_ids, params)


def _token_chunk(output: RequestOutput, eos_token_ids: frozenset[int]) -> dr.InferenceChunk | None:
    completion = output.outputs[0]
    token = output.new_token_ids[0]
    if output.finished and completion.finish_reason == "stop" and token in eos_token_ids:
        return None  # the end-of-sequence token is not part of the answer
    logprobs = None
    if completion.token_logprobs is not None:
        logprobs = [(completion.token_logprobs[-1], list(completion.top_logprobs[-1].items()))]
    return dr.InferenceChunk.tokens([token], logprobs)


async def _protocol_chunks(
    state: ServerState, protocol: Protocol, prepared: _Prepared, request_id: str, usage: dict
) -> AsyncIterator[object]:
    """The protocol's chunks/events, as the engine produces tokens."""
    processor = dr.StreamProcessor(prepared.generator, prepared.conv.parsing_options, state.recipe_tokenizer)
    metrics, started, last = state.metrics, time.monotonic(), None
    done = False
    metrics.prompt_tokens.inc(len(prepared.prompt_ids))
    outputs = state.engine.generate(request_id, prepared.prompt_ids, prepared.params)
    try:
        async for output in outputs:
            now = time.monotonic()
            if last is None:
                metrics.ttft.observe(now - started)
                usage["cached"] = output.num_cached_tokens
                ready = dr.PromptUsage(
                    prompt_tokens=len(prepared.prompt_ids), prompt_cache_hit_tokens=output.num_cached_tokens
                )
                for chunk in processor.push(dr.InferenceChunk.ready(prompt_usage=ready)):
                    yield chunk
            else:
                metrics.tbt.observe(now - last)
            last = now
            metrics.generation_tokens.inc()
            if (chunk_in := _token_chunk(output, state.eos_token_ids)) is not None:
                for chunk in processor.push(chunk_in):
                    yield chunk
            if processor.finished:  # it found a stop sequence and already ended the response
                done = True
                break
            if output.finished:
                reason = _FINISH.get(output.outputs[0].finish_reason, dr.InferenceFinishReason.Stop)
                for chunk in processor.push(dr.InferenceChunk.finish(reason)) + processor.finish():
                    yield chunk
                done = True
    finally:
        await outputs.aclose()  # aborts the request if it did not finish
        if not done:
            processor.close()


def _sse(protocol: Protocol, chunk) -> str:
    name = protocol.response_cls.sse_event_name(chunk)
    event = f"event: {name}\n" if name else ""
    return f"{event}data: {chunk.to_json()}\n\n"


async def run_protocol(state: ServerState, protocol: Protocol, body: dict):
    """-> ("stream", async iterator of SSE text) or ("json", response JSON text). Raises ApiError."""
    request_id = protocol.id_prefix + uuid.uuid4().hex
    prepared = _prepare(state, protocol, body, request_id)
    usage: dict = {}
    chunks = _protocol_chunks(state, protocol, prepared, request_id, usage)
    try:
        first = await anext(chunks)  # surfaces refusals (overload, engine errors) before any bytes are sent
    except DeepInferError:
        await chunks.aclose()
        raise
    if prepared.conv.stream:

        async def sse() -> AsyncIterator[str]:
            try:
                yield _sse(protocol, first)
                async for chunk in chunks:
                    yield _sse(protocol, chunk)
                if (done := protocol.response_cls.sse_done_data()) is not None:
                    yield f"data: {done}\n\n"
            finally:  # a client that went away: abort now, not when the generator is collected
                await chunks.aclose()

        return "stream", sse()
    try:
        collected = [first] + [chunk async for chunk in chunks]
    finally:
        await chunks.aclose()
    response = protocol.response_cls(
        request_id, state.served_model_name, int(time.time()), len(prepared.prompt_ids), usage.get("cached", 0)
    )
    for chunk in collected:
        response.accumulate(chunk)
    return "json", json.dumps(json.loads(response.to_json()))
