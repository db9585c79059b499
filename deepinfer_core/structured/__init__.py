"""Structured outputs (issue #19): a request's output held to a JSON Schema, a regex, a choice or a grammar.

`StructuredOutputsParams` is what a request asks for (vLLM's spelling); `GrammarCompiler` turns it into a grammar
for the served model's tokenizer with llguidance (compiled once per distinct request, cached); `GrammarState` is
one sequence's place in its grammar: the tokens it may emit next, as a row of sampling/bitmask.py's int32 mask.
"""

from deepinfer_core.structured.grammars import GrammarCompiler, GrammarState, StructuredOutputError
from deepinfer_core.structured.params import StructuredOutputsParams
from deepinfer_core.structured.stats import StructuredOutputStats

__all__ = [
    "GrammarCompiler",
    "GrammarState",
    "StructuredOutputError",
    "StructuredOutputStats",
    "StructuredOutputsParams",
]
