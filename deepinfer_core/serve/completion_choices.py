"""The choices of a `/v1/completions` answer, in vLLM's shape: whole (`final_choice`), streamed
(`ChoiceStream`: per-sample deltas, as the engine reports them), logprobs in the
legacy `{tokens, token_logprobs, top_logprobs, text_offset}` form, and usage."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deepinfer_core.engine.request import CompletionOutput, Logprob, RequestOutput

if TYPE_CHECKING:
    from deepinfer_core.serve.completions import CompletionRequest
    from deepinfer_core.serve.state import ServerState

__all__ = ["ChoiceStream", "Prompt", "final_choice", "usage"]

_FLOOR = -9999.0  # vLLM's floor for -inf logprobs (JSON has no infinity)


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str | None  # as sent; None for token ids (decoded when echoed)


def _logprobs_json(
    state: ServerState,
    request: CompletionRequest,
    token_ids: Sequence[int],
    entries: Sequence[dict[int, Logprob] | None],
    offset: int = 0,
) -> dict:
    """vLLM's legacy-completions logprobs: per token its text, logprob, the top `request.logprobs`
    alternatives (the chosen token first, so up to logprobs + 1 entries, as OpenAI documents) and its
    offset in the text. A token without an entry (the prompt's first) has null logprobs."""

    def name(token: int, logprob: Logprob | None) -> str:
        if request.tokens_as_ids:
            return f"token_id:{token}"
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return state.tokenizer.decode([token])

    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token, entry in zip(token_ids, entries):
        chosen = entry.get(token) if entry else None
        text = name(token, chosen)
        tokens.append(text)
        token_logprobs.append(None if chosen is None else max(chosen.logprob, _FLOOR))
        if entry is None:
            top_logprobs.append(None)
        else:
            ranked = list(entry.items())[: request.logprobs + 1]
            top_logprobs.append({name(t, lp): max(lp.logprob, _FLOOR) for t, lp in ranked})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def _prompt_logprobs_json(entries: Sequence[dict[int, Logprob] | None]) -> list:
    """vLLM's `prompt_logprobs` field: per prompt token None or {token id: {logprob, rank, decoded_token}}."""
    return [
        None
        if entry is None
        else {
            str(t): {"logprob": max(lp.logprob, _FLOOR), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in entry.items()
        }
        for entry in entries
    ]


def _prompt_text(state: ServerState, prompt: Prompt) -> str:
    if prompt.text is not None:
        return prompt.text
    return state.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)  # vLLM echoes them


def _prompt_entries(prompt: Prompt, prompt_logprobs) -> list:
    return list(prompt_logprobs) if prompt_logprobs is not None else [None] * len(prompt.token_ids)


def final_choice(
    state: ServerState,
    request: CompletionRequest,
    prompt: Prompt,
    prompt_logprobs: list | None,
    sample: CompletionOutput,
    base_index: int,
) -> dict:
    """One choice of a whole (not streamed) answer."""
    text, token_ids = sample.text, list(sample.token_ids)
    entries = list(sample.logprobs) if sample.logprobs is not None else [None] * len(token_ids)
    if request.echo_only:
        text, token_ids = _prompt_text(state, prompt), list(prompt.token_ids)
        entries = _prompt_entries(prompt, prompt_logprobs)
    elif request.echo:
        text = _prompt_text(state, prompt) + text
        token_ids = [*prompt.token_ids, *token_ids]
        entries = _prompt_entries(prompt, prompt_logprobs) + entries
    logprobs = None if request.logprobs is None else _logprobs_json(state, request, token_ids, entries)
    choice = {
        "index": base_index + sample.index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": sample.finish_reason,
        "stop_reason": sample.stop_reason,
    }
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = _prompt_logprobs_json(prompt_logprobs)
    return choice


@dataclass
class _Sent:
    """What a streamed choice has sent so far."""

    offset: int = 0  # text_offset of the next token with logprobs
    generated: int = 0  # tokens generated
    echoed: bool = False
    finished: bool = False  # its finish_reason is sent (the engine's last report lists every sample again)


@dataclass
class ChoiceStream:
    """The streamed choices of one prompt: each report of its samples becomes chunk choices."""

    state: ServerState
    request: CompletionRequest
    prompt: Prompt
    sent: dict[int, _Sent] = field(default_factory=dict)
    prompt_logprobs: list | None = None

    @property
    def num_generated(self) -> int:
        return 0 if self.request.echo_only else sum(s.generated for s in self.sent.values())

    def chunks(self, output: RequestOutput, base_index: int) -> list[dict]:
        self.prompt_logprobs = self.prompt_logprobs or output.prompt_logprobs
        return [c for sample in output.outputs if (c := self._choice(sample, base_index)) is not None]

    def _choice(self, sample: CompletionOutput, base_index: int) -> dict | None:
        request, sent = self.request, self.sent.setdefault(sample.index, _Sent())
        if sent.finished:
            return None
        text, token_ids, entries = "", [], []
        if request.echo and not sent.echoed:
            sent.echoed = True
            text = _prompt_text(self.state, self.prompt)
            token_ids, entries = list(self.prompt.token_ids), _prompt_entries(self.prompt, self.prompt_logprobs)
        finish = sample.finish_reason
        sent.finished = finish is not None
        if not request.echo_only:  # the engine's delta never holds the start of a stop string
            text += sample.new_text
            sent.generated = len(sample.token_ids)
            if sample.logprobs is not None and sample.new_token_ids:
                token_ids += sample.new_token_ids
                entries += sample.logprobs[len(sample.logprobs) - len(sample.new_token_ids) :]
        if not text and finish is None and (request.logprobs is None or not token_ids):
            return None
        logprobs = None
        if request.logprobs is not None:
            logprobs = _logprobs_json(self.state, request, token_ids, entries, sent.offset)
            sent.offset += sum(len(t) for t in logprobs["tokens"])
        return {
            "index": base_index + sample.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": sample.stop_reason,
        }


def usage(
    request: CompletionRequest, outputs: Sequence[RequestOutput | None], streams: Sequence[ChoiceStream] = ()
) -> dict:
    """Prompt tokens once per prompt; completion tokens of the returned samples (vLLM's counting)."""
    prompt_tokens = sum(len(p.token_ids) for p in request.prompts)
    if streams:
        generated = sum(s.num_generated for s in streams)
    elif request.echo_only:
        generated = 0
    else:
        generated = sum(len(c.token_ids) for o in outputs if o is not None for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs if o is not None)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": prompt_tokens + generated,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
