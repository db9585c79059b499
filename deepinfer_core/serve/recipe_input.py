"""What one sample's engine output becomes as deepseek-recipe's input: token chunks (skipped special tokens
as empty text), held back by `StopGate` while the engine's text may still become a stop string."""

from __future__ import annotations

from dataclasses import dataclass, field

import deepseek_recipe as dr

from deepinfer_core.engine.request import CompletionOutput
from deepinfer_core.engine.stops import held_back
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.serve.state import ServerState

__all__ = ["StopGate", "inference_chunks", "is_fragment"]


def inference_chunks(state: ServerState, params: SamplingParams, sample: CompletionOutput):
    """The recipe's input for one sample's new tokens. A token that is no text (end of sequence, a special
    token it skips) is counted but carries no text: an empty text chunk."""
    drop = state.droppable_special_ids if params.skip_special_tokens else frozenset()
    new = sample.new_token_ids
    first = len(sample.token_ids) - len(new)
    for k, token in enumerate(new):
        if token in state.eos_token_ids or token in drop:
            yield dr.InferenceChunk.text("", 1)
            continue
        logprobs = None
        if sample.token_logprobs is not None:
            logprobs = [(sample.token_logprobs[first + k], list(sample.top_logprobs[first + k].items()))]
        yield dr.InferenceChunk.tokens([token], logprobs)


def is_fragment(state: ServerState, chunk) -> bool:
    """A token holding part of a character that later tokens complete (the engine's text waits for them)."""
    return chunk.kind == "tokens" and "\ufffd" in state.tokenizer.decode(chunk.token_ids, skip_special_tokens=False)


@dataclass
class StopGate:
    """One sample's recipe input, held back while the engine's text may still become a stop string.

    A token goes to the recipe once the engine's text up to its end can no longer turn into a stop string
    (the engine holds back the same text). When the engine ends the sample at a stop string, it cuts its
    text there: the held tokens wholly before the cut go as tokens, the rest as one text chunk of the text
    up to the cut that counts them all (the recipe takes text with a token count), so the answer ends
    exactly where the engine's does and usage still counts every token. Those last tokens have no
    logprobs entry (a text chunk carries none): usually just the one that completed the stop string.
    """

    stops: tuple[str, ...]
    held: list[tuple[object, int | None]] = field(default_factory=list)  # (recipe chunk, end of its text)
    text_len: int = 0  # the engine's text at the last report
    released_end: int = 0  # the engine's text the released chunks cover

    def hold(self, state: ServerState, sample: CompletionOutput, chunks: list) -> None:
        """Queue one report's recipe input, each token with where its text ends in the engine's text; None:
        not known alone (a character split across tokens, or tokens past a stop string's cut)."""
        cut = isinstance(sample.stop_reason, str)
        grew, self.text_len = len(sample.text) > self.text_len, len(sample.text)
        for k, chunk in enumerate(chunks):
            # the engine reports one token per sample per step; of several, only the last one's end is known
            end = len(sample.text) if k == len(chunks) - 1 and not cut else None
            if end is not None and self.stops and not grew and is_fragment(state, chunk):
                end = None
            self.held.append((chunk, end))

    def release(self, sample: CompletionOutput) -> list:
        """The held input the recipe may have now."""
        cut = isinstance(sample.stop_reason, str)
        if not self.stops or (sample.finish_reason is not None and not cut):
            released, self.held = [chunk for chunk, _ in self.held], []
            return released
        limit = len(sample.text) - (0 if cut else held_back(sample.text, self.stops))
        taken = 0  # held entries released
        for position, (_, end) in enumerate(self.held, start=1):
            if end is not None:
                if end > limit:
                    break
                taken, self.released_end = position, end
        released, self.held = [chunk for chunk, _ in self.held[:taken]], self.held[taken:]
        if cut and self.held:
            released.append(dr.InferenceChunk.text(sample.text[self.released_end :], len(self.held)))
            self.held = []
        return released
