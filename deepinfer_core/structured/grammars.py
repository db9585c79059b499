"""Grammars for structured outputs, compiled by llguidance for the served model's tokenizer.

llguidance (no dependencies, a 7.6 MB wheel) was chosen over xgrammar (which pulls transformers, triton and
apache-tvm-ffi) on bench/grammar_engines.py's numbers: both mask a 129k-token vocabulary in 10-20 us a token after
the first; llguidance compiles lazily (1 ms against xgrammar's 23 ms for the bench's schema). See README.md.

A request's constraint compiles once into a grammar text (cached by `StructuredOutputsParams.key()`, checked
against the tokenizer: an invalid schema, regex or grammar is a StructuredOutputError naming the problem); each
sequence then walks it with its own matcher (`GrammarState`).
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import torch

from deepinfer_core.errors import RequestError
from deepinfer_core.sampling.bitmask import bitmask_width
from deepinfer_core.structured.params import StructuredOutputsParams
from deepinfer_core.structured.stats import StructuredOutputStats

__all__ = [
    "GrammarCompiler",
    "GrammarState",
    "StructuredOutputError",
    "after_reasoning",
    "fill_masks",
    "mask_filler",
]


class StructuredOutputError(RequestError):
    """A request's structured-output constraint cannot be used (bad schema, regex or grammar; a tokenizer that
    llguidance cannot read)."""


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer: `tokenizer_json` (the tokenizer.json text), the
    model's vocabulary (mask width: logits rows may be wider than the tokenizer) and its end-of-sequence ids
    (what a finished grammar allows). Thread-safe; keeps the last `cache_size` grammars."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        cache_size: int = 256,
    ):
        import llguidance

        self._llg = llguidance
        eos = sorted(t for t in eos_token_ids if 0 <= t < vocab_size)
        try:
            self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos or None)
        except Exception as err:  # llguidance reads byte-level BPE tokenizers (DeepSeek's); not word-level ones
            raise StructuredOutputError(
                f"structured outputs need a tokenizer llguidance can read; this model's cannot be used ({err})"
            ) from None
        self.vocab_size = vocab_size
        self._cache: OrderedDict[tuple, tuple[str, object]] = OrderedDict()  # key -> (grammar, start matcher)
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.stats = StructuredOutputStats()

    def grammar(self, params: StructuredOutputsParams) -> str:
        """The checked llguidance grammar of `params` (from the cache when an equal request compiled it)."""
        return self._entry(params)[0]

    def state(self, params: StructuredOutputsParams) -> GrammarState:
        """A sequence's walk through `params`' grammar, at its start: a copy of the grammar's matcher at its start
        (about a microsecond; a new matcher parses the grammar again, ~0.3-0.9 ms)."""
        template = self._entry(params)[1]
        with self._lock:
            matcher = template.deep_copy()
        return GrammarState(matcher, self.vocab_size)

    def _entry(self, params: StructuredOutputsParams) -> tuple[str, object]:
        """(grammar text, a matcher at its start, never advanced) of `params`, compiled on a cache miss."""
        key = params.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        start = time.perf_counter()
        grammar = self._compile(params)
        entry = (grammar, self._llg.LLMatcher(self.tokenizer, grammar))
        # The first mask of a grammar builds its lexer's start states (~0.4 ms for a regex over a 129k vocabulary);
        # built here, off the engine loop, they are shared by every copy of this matcher.
        GrammarState(entry[1], self.vocab_size).fill(
            torch.empty(1, bitmask_width(self.vocab_size), dtype=torch.int32), 0
        )
        self.stats.compile_seconds.append(time.perf_counter() - start)
        with self._lock:
            self._cache[key] = entry
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return entry

    def _compile(self, params: StructuredOutputsParams) -> str:
        llg, kind = self._llg.LLMatcher, params.kind
        try:
            if kind in ("json", "json_object"):
                schema = {"type": "object"} if kind == "json_object" else params.json
                text = schema if isinstance(schema, str) else json.dumps(schema)
                grammar = llg.grammar_from_json_schema(
                    text, defaults={"whitespace_flexible": not params.disable_any_whitespace}
                )
            elif kind == "regex":
                grammar = llg.grammar_from_regex(params.regex)
            elif kind == "choice":
                grammar = self._llg.grammar_from("choice", json.dumps(list(params.choice)))
            else:
                grammar = self._llg.grammar_from("grammar", params.grammar)
        except (ValueError, TypeError) as err:
            raise StructuredOutputError(f"structured outputs' {kind} cannot be compiled: {err}") from None
        if params.reasoning_end_token_id is not None:
            grammar = after_reasoning(grammar, params.reasoning_end_token_id)
        error = llg.validate_grammar(grammar, self.tokenizer)
        if error:
            raise StructuredOutputError(f"structured outputs' {kind} is not valid: {error.strip()}")
        return grammar


def after_reasoning(grammar: str, end_token: int) -> str:
    """`grammar` (llguidance's JSON form or Lark text) behind free text that ends with token `end_token`: a
    thinking-mode answer, constrained once its reasoning is over. (The end of thinking is a special token, which
    no text matches; so the reasoning is a plain greedy lexeme.)"""
    if grammar.lstrip().startswith("{"):
        body = json.loads(grammar)["grammars"][0]
    else:
        body = {"lark_grammar": grammar}
    main = {"name": "main", "lark_grammar": f"start: reasoning @body\nreasoning: /(?s:.*)/ <[{end_token}]>\n"}
    return json.dumps({"grammars": [main, {**body, "name": "body"}]})


class GrammarState:
    """One sequence's place in its grammar: which tokens it may emit next (`fill`, or `fill_masks` for a step's
    rows), and the tokens it emitted (`accept`). `finished`: the grammar is complete and allows only
    end-of-sequence from here."""

    def __init__(self, matcher, vocab_size: int) -> None:
        if matcher.is_error():
            raise StructuredOutputError(f"structured outputs' grammar failed to start: {matcher.get_error()}")
        from llguidance.torch import fill_next_token_bitmask

        self._matcher, self._fill = matcher, fill_next_token_bitmask
        self.width = bitmask_width(vocab_size)

    def fill(self, bitmask: torch.Tensor, row: int, drafts: Sequence[int] = ()) -> None:
        """Write the allowed next tokens into row `row` of an int32 [rows, width] host bitmask: after `drafts`
        where given (a verify step's drafted tokens before that row; the state is rolled back after). A row whose
        drafts the grammar refuses is left as it was (unmasked, when the caller set it to -1): the row of the first
        refused draft cannot sample it, so the drafts after it, and this row's token, are never kept."""
        taken = self._matcher.try_consume_tokens(list(drafts)) if drafts else 0
        if taken == len(drafts):
            self._fill(self._matcher, bitmask, row)
        if taken:
            self._matcher.rollback(taken)

    def accept(self, token: int) -> bool:
        """Advance by an emitted token; False when the grammar does not allow it (the state is then an error)."""
        return bool(self._matcher.consume_token(token))

    @property
    def finished(self) -> bool:
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None


def fill_masks(
    states: Sequence[GrammarState], bitmask: torch.Tensor, drafts: Sequence[Sequence[int]] | None = None
) -> None:
    """Row k of the int32 [len(states), width] host `bitmask` := states[k].fill after drafts[k] (where given):
    without drafts `mask_filler`'s one call, with drafts one row after another."""
    if drafts is None:
        mask_filler(states, bitmask)()
        return
    for k, state in enumerate(states):
        state.fill(bitmask, k, drafts[k])


def mask_filler(states: Sequence[GrammarState], bitmask: torch.Tensor) -> Callable[[], None]:
    """A call that fills row k of the int32 [len(states), width] host `bitmask` with states[k]'s mask: one call into
    llguidance's executor, on one thread, that holds no interpreter lock while it works (so it may run on a worker
    thread beside the engine's Python; the states must not be used elsewhere meanwhile). Several executor threads
    measured slower on the H200's 16-core host (bench/results/grammar_fill_modes_nvidia_h200.json)."""
    rows, width = bitmask.shape
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
        raise ValueError(f"fill_masks writes a contiguous int32 host bitmask, not {bitmask.dtype} on {bitmask.device}")
    if rows < len(states):
        raise ValueError(f"fill_masks needs a row for each of {len(states)} states, not {rows}")
    return functools.partial(
        _executor().unsafe_compute_mask_ptr,
        [(state._matcher, k) for k, state in enumerate(states)],
        bitmask.data_ptr(),
        width * 4,
        rows,
    )


@functools.cache
def _executor():
    import llguidance

    return llguidance.LLExecutor(num_threads=1)
