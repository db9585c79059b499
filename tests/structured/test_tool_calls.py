"""Tool-call grammars (structured/tool_calls.py) and thinking-mode constraints on the demo tokenizer: DeepSeek's
DSML call blocks that follow the tools' schemas walk through token by token and end the output; a wrong tool, a
value outside its schema, a second call where only one may come or DSML markup in free text is refused; the
reasoning before a thinking-mode answer is free and the constraint holds after it; a grammar that takes too long
to compile is refused by the server's engine front."""

from __future__ import annotations

import asyncio
import time

import pytest

from deepinfer_core.engine.tokenizer import Tokenizer, demo_tokenizer_dir
from deepinfer_core.structured import GrammarCompiler, StructuredOutputError, StructuredOutputsParams
from deepinfer_core.structured.tool_calls import tool_call_grammar

VOCAB = 129280
PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"$ref": "#/$defs/Unit"},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "code": {"type": "string", "pattern": "^[A-Z]{2}$"},
    },
    "required": ["city", "unit", "days"],
    "$defs": {"Unit": {"type": "string", "enum": ["c", "f"]}},
}
TOOLS = [("get_weather", PARAMS), ("noop", {"type": "object"})]
CALL = (
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Pa</ris & <b></｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="unit" string="true">c</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
)
CODE = '<｜DSML｜parameter name="code" string="false">{}</｜DSML｜parameter>\n'
NOOP = '<｜DSML｜invoke name="noop">\n</｜DSML｜invoke>\n'
CLOSE = "</｜DSML｜tool_calls>"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(demo_tokenizer_dir())


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.to_json(), VOCAB, [tokenizer.eos_token_id])


def feed(compiler, tokenizer, params: StructuredOutputsParams, text: str, ids: list[int] = ()) -> tuple[bool, bool]:
    """(every token of `ids` + `text` accepted, the grammar then finished by end of sequence)."""
    state = compiler.state(params)
    for token in [*ids, *tokenizer.encode(text, add_special_tokens=False)]:
        if not state.accept(token):
            return False, False
    return True, state.accept(tokenizer.eos_token_id) and state.finished


def with_code(value: str) -> str:
    return CALL.replace("</｜DSML｜invoke>", CODE.format(value) + "</｜DSML｜invoke>")


def calls(mode: str, parallel: bool = True) -> StructuredOutputsParams:
    return StructuredOutputsParams(grammar=tool_call_grammar(TOOLS, mode, parallel))


@pytest.mark.parametrize(
    ("mode", "text", "accepted", "ends"),
    [
        ("opened", CALL + CLOSE, True, True),  # raw string text keeps "<", "</" and "&"
        ("opened", CALL + NOOP + CLOSE, True, True),
        ("opened", CALL.replace('">c<', '">k<') + CLOSE, False, False),  # outside the $ref'd enum
        ("opened", CALL.replace('">3<', '">9<') + CLOSE, False, False),  # above maximum
        ("opened", CALL.replace("get_weather", "get_time") + CLOSE, False, False),  # no such tool
        ("opened", with_code('"FR"') + CLOSE, True, True),  # an optional parameter, its pattern kept
        ("opened", with_code('"Fr"') + CLOSE, False, False),
        ("opened", CALL, True, False),  # the block must close before the end
        ("required", "\n\n<｜DSML｜tool_calls>\n" + CALL + CLOSE, True, True),
        ("required", "Sure, let me check.", False, False),
        ("auto", "No call: a <b>bold</b> answer.", True, True),
        ("auto", "Checking.\n\n<｜DSML｜tool_calls>\n" + CALL + CLOSE, True, True),
        ("auto", "Half a call <｜DSML｜invoke", True, False),
    ],
)
def test_calls_follow_the_tools_schemas(compiler, tokenizer, mode, text, accepted, ends):
    assert feed(compiler, tokenizer, calls(mode), text) == (accepted, ends)


def test_one_call_when_parallel_calls_are_off(compiler, tokenizer):
    assert feed(compiler, tokenizer, calls("opened", parallel=False), CALL + CLOSE) == (True, True)
    assert feed(compiler, tokenizer, calls("opened", parallel=False), CALL + NOOP + CLOSE) == (False, False)


def test_bad_modes_and_empty_tools_are_refused():
    with pytest.raises(ValueError, match="mode"):
        tool_call_grammar(TOOLS, "sometimes")
    with pytest.raises(ValueError, match="at least one tool"):
        tool_call_grammar([], "opened")


def test_thinking_answers_are_constrained_after_the_reasoning(compiler, tokenizer):
    end = tokenizer.encode("</think>", add_special_tokens=False)
    assert len(end) == 1  # a special token: no text of the reasoning can spell it
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    after = StructuredOutputsParams(json=schema, reasoning_end_token_id=end[0])
    thought = tokenizer.encode("Not JSON { at all", add_special_tokens=False)
    assert feed(compiler, tokenizer, after, '{"a":3}', [*thought, *end]) == (True, True)
    assert feed(compiler, tokenizer, after, '{"a":"x"}', [*thought, *end])[0] is False
    assert feed(compiler, tokenizer, after, "")[1] is False  # no answer without ending the reasoning
    plain = StructuredOutputsParams(json=schema)
    assert feed(compiler, tokenizer, plain, "", thought)[0] is False  # without it the first token is JSON
    assert after.key() != plain.key()


def test_a_grammar_that_compiles_too_slowly_is_refused():
    from deepinfer_core.serve.async_engine import AsyncEngine

    class SlowCompiler:
        def grammar(self, params):
            time.sleep(0.5)

    class Engine:
        def structured_compiler(self):
            return SlowCompiler()

    front = AsyncEngine(Engine())
    front.grammar_timeout_s = 0.05

    async def attempt() -> float:
        started = time.perf_counter()
        with pytest.raises(StructuredOutputError, match="did not compile within 0.05 s"):
            await front.compile_structured(StructuredOutputsParams(regex="a+"))
        return time.perf_counter() - started

    assert asyncio.run(attempt()) < 0.45  # refused at the timeout, not after the compile
