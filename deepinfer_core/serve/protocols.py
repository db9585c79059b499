"""Chat Completions, Responses and Messages through deepseek-recipe: request conversion, prompt encoding,
and streaming output parsing are its job; ours is to run the tokens through the engine in between.

The recipe parses one answer per StreamProcessor: a request with n samples (chat's `n`) runs one
processor per sample, and its chunks are re-indexed and merged at the JSON level.

Requests are parsed, converted and encoded in a worker thread (prompt_encoding.py says why).

Stop strings are the engine's alone (it honours min_tokens, as vLLM): the recipe parses without them, and
`StopGate` (recipe_input.py) keeps a stop string's text from ever reaching it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import deepseek_recipe as dr

from deepinfer_core.errors import DeepInferError
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.serve import fields
from deepinfer_core.serve.errors import ApiError, from_conversion_error, invalid_body
from deepinfer_core.serve.prompt_encoding import check_prompt_fits
from deepinfer_core.serve.recipe_input import StopGate, inference_chunks
from deepinfer_core.serve.state import ServerState
from deepinfer_core.serve.structured_fields import (
    check_compiles,
    constraint_field,
    request_constraint,
    structured_outputs_from_body,
)
from deepinfer_core.serve.tool_choice import check_tool_choice

__all__ = ["PROTOCOLS", "Protocol", "encode_prompt", "parse_request", "run_protocol"]


@dataclass(frozen=True)
class Protocol:
    name: str  # metrics label
    route: str  # fields.py's route name
    request_cls: type
    response_cls: type
    id_prefix: str
    prompt_field: str  # the body field of the conversation, named when the prompt is too big
    anthropic: bool = False


PROTOCOLS = {
    "chat": Protocol(
        "chat_completions", "chat", dr.ChatCompletionRequest, dr.ChatCompletionResponse, "chatcmpl-", "messages"
    ),
    "responses": Protocol("responses", "responses", dr.ResponsesRequest, dr.ResponsesResponse, "resp_", "input"),
    "messages": Protocol(
        "messages", "messages", dr.MessagesRequest, dr.MessagesResponse, "msg_", "messages", anthropic=True
    ),
}

_FINISH = {"stop": dr.InferenceFinishReason.Stop, "length": dr.InferenceFinishReason.Length}


@dataclass
class _Prepared:
    conv: dr.ConversationRequest
    parsing: dr.ParsingOptions  # the recipe's, without the stop sequences (the engine applies them)
    generators: list  # one chunk generator per sample
    prompt_ids: list[int]
    params: SamplingParams
    include_usage: bool = False  # chat: stream_options.include_usage
    continuous_usage: bool = False  # chat: stream_options.continuous_usage_stats (vLLM)
    generated: list[int] = field(default_factory=list)  # tokens generated so far, per sample
    stop_strings: list[str | None] = field(default_factory=list)  # the stop string that ended each sample


def _parse(state: ServerState, protocol: Protocol, body: dict):
    """-> (the protocol's request, the output limit it asks for or None, the field that asks)."""
    route = protocol.route
    fields.refuse_unsupported(body, route)
    fields.check_sampling_fields(body, route)
    structured_outputs_from_body(body, route)  # before the recipe, whose refusals do not name the field
    requested, length_field = fields.requested_max_tokens(body, route, max_model_len=state.max_model_len)
    if route == "chat":
        _stream_options(body)  # before the recipe, whose refusal does not name the field
    return parse_request(state, protocol, body), requested, length_field


def parse_request(state: ServerState, protocol: Protocol, body: dict):
    """The protocol's request for `body` (tool_choice checked first), for the served model only."""
    check_tool_choice(body, protocol.route)
    recipe_body = {k: v for k, v in body.items() if k != "n"} if protocol.route == "chat" else body  # ours
    try:
        request = protocol.request_cls(recipe_body)
    except (ValueError, TypeError, OverflowError, RecursionError) as err:  # an integer too big, nesting too deep
        raise invalid_body(err) from None
    if request.model != state.served_model_name:
        raise ApiError(
            404,
            f"The model `{request.model}` does not exist; this server serves `{state.served_model_name}`.",
            param="model",
            code="model_not_found",
        )
    return request


def encode_prompt(state: ServerState, protocol: Protocol, request, *, must_fit: bool = True):
    """-> (the converted request, its prompt's token ids). `must_fit`: a prompt too big for the context is a
    400 before it is encoded."""
    try:
        conv = request.convert(state.options)
        if must_fit:
            prompt = state.encoding.render_conversation(conv.conversation).prompt
            check_prompt_fits(state, prompt, protocol.prompt_field)
        return conv, state.encoding.encode(conv.conversation)
    except dr.ConversionError as err:
        raise from_conversion_error(err) from None


def _prepare(state: ServerState, protocol: Protocol, body: dict, request_id: str) -> _Prepared:
    request, requested, length_field = _parse(state, protocol, body)
    extras = {}
    if protocol.request_cls is dr.ResponsesRequest:  # read before convert consumes the request
        extras = {"tools": request.namespace_tool_map(state.options), "echo": request.echo()}
    conv, prompt_ids = encode_prompt(state, protocol, request)
    options = conv.inference_options
    room = state.kv_capacity_tokens - len(prompt_ids)  # an absent limit must not exceed the KV cache
    default = state.default_max_tokens if room < 1 else min(room, state.default_max_tokens or room)
    max_tokens = fields.resolve_max_tokens(
        requested,
        length_field,
        prompt_len=len(prompt_ids),
        max_model_len=state.max_model_len,
        default_max_tokens=default,
    )
    params = fields.sampling_params_from_body(
        body,
        route=protocol.route,
        max_tokens=max_tokens,
        temperature=options.temperature,  # the recipe's, which knows the model version's rules
        top_p=options.top_p,
        seed=options.seed,
        stop=tuple(conv.parsing_options.stop_sequences) or None,
        logprobs=(options.top_logprobs or 0) if options.logprobs else None,
    )
    constraint = options.output_constraint  # deepseek-recipe's reading of the format; the schema comes from the body
    if constraint is not None and constraint.kind in fields.GUIDED_CONSTRAINTS and params.structured_outputs is None:
        param = fields.CONSTRAINT_FIELDS[protocol.route]
        raise ApiError(400, f"unsupported parameter {param}: only text output is supported here", param=param)
    wanted = request_constraint(params.structured_outputs, body, protocol.route, conv, state.thinking_end_id)
    params = replace(params, structured_outputs=wanted)
    make = protocol.request_cls.chunk_generator
    generators = [make(conv, request_id, state.served_model_name) for _ in range(params.n)]
    if extras:
        generators = [g.with_namespace_tool_map(extras["tools"]).with_echo(extras["echo"]) for g in generators]
    stream_options = _stream_options(body) if protocol.route == "chat" else {}
    parsing = conv.parsing_options  # a copy
    parsing.stop_sequences = []
    return _Prepared(
        conv,
        parsing,
        generators,
        prompt_ids,
        params,
        include_usage=stream_options.get("include_usage") is True,
        continuous_usage=stream_options.get("continuous_usage_stats") is True,
        generated=[0] * params.n,
        stop_strings=[None] * params.n,
    )


def _stream_options(body: dict) -> dict:
    options = body.get("stream_options")
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ApiError(400, "invalid value for stream_options: expected an object", param="stream_options")
    if body.get("stream") is not True:  # vLLM's rule
        raise ApiError(400, "stream_options can only be given with stream: true", param="stream_options")
    for name in ("include_usage", "continuous_usage_stats"):
        if options.get(name) is not None and not isinstance(options[name], bool):
            raise ApiError(
                400, f"invalid value for stream_options.{name}: expected true or false", param=f"stream_options.{name}"
            )
    return options


async def _protocol_chunks(
    state: ServerState, prepared: _Prepared, request_id: str, usage: dict
) -> AsyncIterator[tuple[int, object]]:
    """(sample index, the protocol's chunk/event), as the engine produces tokens."""
    processors = [dr.StreamProcessor(g, prepared.parsing, state.recipe_tokenizer) for g in prepared.generators]
    gates = [StopGate(prepared.params.stop or ()) for _ in processors]
    running = set(range(len(processors)))  # samples whose processor has not ended
    ready_sent = False
    outputs = state.engine.generate(request_id, prepared.prompt_ids, prepared.params)

    def end(index: int, reason) -> list:
        running.discard(index)
        return processors[index].push(dr.InferenceChunk.finish(reason)) + processors[index].finish()

    try:
        async for output in outputs:  # the async engine records the token metrics of every route
            if not ready_sent:
                ready_sent, usage["cached"] = True, output.num_cached_tokens
                ready = dr.PromptUsage(
                    prompt_tokens=len(prepared.prompt_ids), prompt_cache_hit_tokens=output.num_cached_tokens
                )
                for index, processor in enumerate(processors):
                    for chunk in processor.push(dr.InferenceChunk.ready(prompt_usage=ready)):
                        yield index, chunk
            for sample in output.outputs:
                index = sample.index
                if index not in running:
                    continue
                processor, gate = processors[index], gates[index]
                prepared.generated[index] = len(sample.token_ids)
                gate.hold(state, sample, list(inference_chunks(state, prepared.params, sample)))
                for chunk_in in gate.release(sample):
                    for chunk in processor.push(chunk_in):
                        yield index, chunk
                    if processor.finished:  # the recipe ended the answer itself (it has no stop sequences)
                        running.discard(index)
                        break
                else:
                    if sample.finish_reason is not None:
                        if isinstance(sample.stop_reason, str):
                            prepared.stop_strings[index] = sample.stop_reason
                        for chunk in end(index, _FINISH.get(sample.finish_reason, dr.InferenceFinishReason.Stop)):
                            yield index, chunk
            if output.finished:  # samples the last report did not list as finished (none, normally)
                for index in sorted(running):
                    for chunk in end(index, dr.InferenceFinishReason.Stop):
                        yield index, chunk
            if not running:
                break
    finally:
        await outputs.aclose()  # aborts the request if it did not finish
        for index in running:
            processors[index].close()


# ---- the protocols' JSON: re-indexed choices, usage where OpenAI puts it, applied settings echoed ---------


def _empty_delta(event: dict) -> bool:
    """A chunk/event that carries nothing: the trace of a token with no text."""
    if "choices" in event:  # chat
        return bool(event["choices"]) and all(
            c.get("finish_reason") is None and c.get("logprobs") is None and not any(c.get("delta", {}).values())
            for c in event["choices"]
        )
    if event.get("type") == "content_block_delta":  # messages
        delta = event.get("delta", {})
        return delta.get("type") in ("text_delta", "thinking_delta") and not delta.get("text", delta.get("thinking"))
    if str(event.get("type", "")).endswith(".delta") and "delta" in event:  # responses
        return event["delta"] == "" and not event.get("logprobs")
    return False


def _merge_usage(usages: list[dict]) -> dict:
    """One usage for n samples of one prompt: completion counts add up, prompt counts do not."""
    merged = dict(usages[0])
    merged["completion_tokens"] = sum(u["completion_tokens"] for u in usages)
    merged["total_tokens"] = merged["prompt_tokens"] + merged["completion_tokens"]
    if all("completion_tokens_details" in u for u in usages):
        reasoning = sum((u["completion_tokens_details"] or {}).get("reasoning_tokens") or 0 for u in usages)
        merged["completion_tokens_details"] = {**(usages[0]["completion_tokens_details"] or {})}
        merged["completion_tokens_details"]["reasoning_tokens"] = reasoning
    return merged


def _stop_sequence(prepared: _Prepared, index: int, target: dict) -> None:
    """Messages: the recipe, which parses without the stop sequences, says `end_turn` where the engine
    stopped at one; Anthropic says `stop_sequence` and names it."""
    stop = prepared.stop_strings[index]
    if stop is not None and target.get("stop_reason") == "end_turn":
        target["stop_reason"], target["stop_sequence"] = "stop_sequence", stop


def _echo_applied(prepared: _Prepared, response: dict) -> None:
    """Responses objects echo the sampling settings: report the ones the sampler applies (the recipe's
    response object says 0.0 for the penalties whatever was asked, and the requested temperature even
    where the model version's rules replace it)."""
    for name in ("temperature", "top_p", "frequency_penalty", "presence_penalty"):
        response[name] = getattr(prepared.params, name)


class _StreamWriter:
    """The SSE text of a request's chunks, in the protocol's wire format."""

    def __init__(self, protocol: Protocol, prepared: _Prepared) -> None:
        self.protocol, self.prepared = protocol, prepared
        self.sequence = 0  # responses: events are renumbered after dropping empty ones
        self.usages: dict[int, dict] = {}  # chat: each sample's usage, from its last chunk
        self.envelope: dict | None = None  # chat: id, object, created, model of the chunks

    def write(self, index: int, chunk) -> str:
        event = json.loads(chunk.to_json())
        name = self.protocol.response_cls.sse_event_name(chunk)
        route = self.protocol.route
        if route == "chat":
            event = self._chat(index, event)
        elif route == "messages" and event.get("type") == "message_delta":
            _stop_sequence(self.prepared, index, event.get("delta", {}))
        if event is None or _empty_delta(event):
            return ""
        if route == "responses":
            event["sequence_number"], self.sequence = self.sequence, self.sequence + 1
            if isinstance(event.get("response"), dict):
                _echo_applied(self.prepared, event["response"])
        prefix = f"event: {name}\n" if name else ""
        return f"{prefix}data: {json.dumps(event, ensure_ascii=False)}\n\n"

    def _chat(self, index: int, event: dict) -> dict | None:
        for choice in event.get("choices", []):
            choice["index"] = index
        if (usage := event.pop("usage", None)) is not None:
            self.usages[index] = usage
        if self.envelope is None:
            keys = ("id", "object", "created", "model", "system_fingerprint")
            self.envelope = {k: event[k] for k in keys if k in event}
        if self.prepared.include_usage:  # OpenAI: null on every chunk but the last, unless continuous (vLLM)
            event["usage"] = self._running_usage() if self.prepared.continuous_usage else None
        return event

    def _running_usage(self) -> dict:
        prompt, generated = len(self.prepared.prompt_ids), sum(self.prepared.generated)
        return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}

    def close(self) -> str:
        """The last messages: chat's usage chunk (include_usage), the protocol's [DONE]."""
        text = ""
        if self.protocol.route == "chat" and self.prepared.include_usage and self.usages and self.envelope:
            usage = _merge_usage([self.usages[i] for i in sorted(self.usages)])
            last = {**self.envelope, "choices": [], "usage": usage}
            text += f"data: {json.dumps(last, ensure_ascii=False)}\n\n"
        if (done := self.protocol.response_cls.sse_done_data()) is not None:
            text += f"data: {done}\n\n"
        return text


def _response_json(state: ServerState, protocol: Protocol, prepared: _Prepared, request_id: str, collected, cached):
    """The whole (non-streamed) response: one recipe response per sample, merged."""
    created = int(time.time())
    responses = [
        protocol.response_cls(request_id, state.served_model_name, created, len(prepared.prompt_ids), cached)
        for _ in prepared.generators
    ]
    for index, chunk in collected:
        responses[index].accumulate(chunk)
    bodies = [json.loads(r.to_json()) for r in responses]
    body = bodies[0]
    if protocol.route == "chat":
        body["choices"] = [{**c, "index": i} for i, b in enumerate(bodies) for c in b["choices"]]
        body["usage"] = _merge_usage([b["usage"] for b in bodies])
    elif protocol.route == "responses":
        _echo_applied(prepared, body)
    elif protocol.route == "messages":
        _stop_sequence(prepared, 0, body)
    return json.dumps(body, ensure_ascii=False)


async def run_protocol(state: ServerState, protocol: Protocol, body: dict):
    """-> ("stream", async iterator of SSE text) or ("json", response JSON text). Raises ApiError."""
    request_id = protocol.id_prefix + uuid.uuid4().hex
    prepared = await asyncio.to_thread(_prepare, state, protocol, body, request_id)
    await check_compiles(state.engine, prepared.params.structured_outputs, constraint_field(body, protocol.route))
    usage: dict = {}
    chunks = _protocol_chunks(state, prepared, request_id, usage)
    try:
        first = await anext(chunks)  # surfaces refusals (overload, engine errors) before any bytes are sent
    except DeepInferError:
        await chunks.aclose()
        raise
    if prepared.conv.stream:
        writer = _StreamWriter(protocol, prepared)

        async def sse() -> AsyncIterator[str]:
            try:
                if text := writer.write(*first):
                    yield text
                async for index, chunk in chunks:
                    if text := writer.write(index, chunk):
                        yield text
                yield writer.close()
            finally:  # a client that went away: abort now, not when the generator is collected
                await chunks.aclose()

        return "stream", sse()
    try:
        collected = [first] + [item async for item in chunks]
    finally:
        await chunks.aclose()
    return "json", _response_json(state, protocol, prepared, request_id, collected, usage.get("cached", 0))
