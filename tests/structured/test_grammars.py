"""Structured outputs' grammars on the demo model's tokenizer (DeepSeek-V4's, 129k tokens): the masks allow
exactly the continuations the constraint allows, walking a valid output token by token; bad constraints are
refused with the reason; equal constraints compile once."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer_core.engine.tokenizer import Tokenizer, demo_tokenizer_dir
from deepinfer_core.errors import RequestError
from deepinfer_core.sampling.bitmask import allowed_tokens
from deepinfer_core.structured import GrammarCompiler, StructuredOutputError, StructuredOutputsParams
from deepinfer_core.structured.grammars import fill_masks

VOCAB = 129280  # the demo model's logits rows
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "role": {"enum": ["admin", "user"]}},
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(demo_tokenizer_dir())


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer._tokenizer.to_str(), VOCAB, [tokenizer.eos_token_id])


def allowed(state) -> torch.Tensor:
    mask = torch.zeros(1, state.width, dtype=torch.int32)
    state.fill(mask, 0)
    return allowed_tokens(mask, VOCAB)[0]


def walk(compiler, tokenizer, params, text: str) -> list[torch.Tensor]:
    """The mask before each token of `text`, each token checked against it and fed."""
    state, masks = compiler.state(params), []
    for token in tokenizer.encode(text, add_special_tokens=False):
        masks.append(allowed(state))
        assert masks[-1][token], f"token {token} ({tokenizer.decode([token])!r}) of a valid output was masked"
        assert state.accept(token)
    masks.append(allowed(state))
    return masks


def test_a_valid_json_document_walks_through_and_only_end_of_sequence_follows(compiler, tokenizer):
    text = json.dumps({"name": "Ada", "age": 36, "role": "admin"}, separators=(",", ":"))
    masks = walk(compiler, tokenizer, StructuredOutputsParams(json=SCHEMA), text)
    first, last = masks[0], masks[-1]
    assert first[tokenizer.encode('{"', add_special_tokens=False)[0]]  # a required key must follow the brace
    for wrong in ("[", " ", "\n", "42", "Ada", "{}"):  # not this object's start; compact: no leading whitespace
        assert not first[tokenizer.encode(wrong, add_special_tokens=False)[0]], wrong
    assert last.nonzero().flatten().tolist() == [tokenizer.eos_token_id]


def test_whitespace_is_allowed_only_when_asked_for(compiler, tokenizer):
    space = tokenizer.encode(" ", add_special_tokens=False)[0]
    after_brace = {}
    for compact in (True, False):
        state = compiler.state(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=compact))
        assert state.accept(tokenizer.encode("{", add_special_tokens=False)[0])
        after_brace[compact] = bool(allowed(state)[space])
    assert after_brace == {True: False, False: True}


def test_enum_values_outside_the_schema_are_masked(compiler, tokenizer):
    params = StructuredOutputsParams(json=SCHEMA)
    state = compiler.state(params)
    for token in tokenizer.encode('{"name":"A","age":1,"role":"', add_special_tokens=False):
        assert state.accept(token)
    mask = allowed(state)
    assert mask[tokenizer.encode("admin", add_special_tokens=False)[0]]
    assert not mask[tokenizer.encode("guest", add_special_tokens=False)[0]]


def test_regex_and_choice(compiler, tokenizer):
    digits = walk(compiler, tokenizer, StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"), "555-1234")
    assert not digits[0][tokenizer.encode("a", add_special_tokens=False)[0]]
    assert digits[-1].nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    choice = StructuredOutputsParams(choice=["positive", "negative"])
    masks = walk(compiler, tokenizer, choice, "negative")
    assert not masks[0][tokenizer.encode("neutral", add_special_tokens=False)[0]]


def test_lark_grammar(compiler, tokenizer):
    params = StructuredOutputsParams(grammar='start: "SELECT " NAME " FROM " NAME\nNAME: /[a-z]+/')
    masks = walk(compiler, tokenizer, params, "SELECT id FROM users")
    assert not masks[0][tokenizer.encode("DROP", add_special_tokens=False)[0]]


@pytest.mark.parametrize(
    "params,needle",
    [
        (dict(regex="a(b"), "regex"),
        (dict(json={"type": "objectx"}), "objectx"),
        (dict(grammar='start: "a" undefined_rule'), "undefined_rule"),
    ],
    ids=["regex", "schema", "grammar"],
)
def test_bad_constraints_are_refused_with_the_reason(compiler, params, needle):
    with pytest.raises(StructuredOutputError, match=needle) as caught:
        compiler.grammar(StructuredOutputsParams(**params))
    assert isinstance(caught.value, RequestError)  # a 400 at the API


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({}, "exactly one"),
        (dict(regex="a", choice=["a"]), "exactly one"),
        (dict(json="{not json"), "not valid JSON"),
        (dict(choice="abc"), "list of strings"),
        (dict(choice=[]), "exactly one|list of strings"),
        (dict(regex=""), "exactly one|non-empty"),
    ],
)
def test_params_validate_their_fields(kwargs, needle):
    with pytest.raises(RequestError, match=needle):
        StructuredOutputsParams(**kwargs)


def test_equal_constraints_compile_once(compiler, monkeypatch):
    calls = []
    original = compiler._compile
    monkeypatch.setattr(compiler, "_compile", lambda params: calls.append(params) or original(params))
    schema = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "string"}}}
    compiler.grammar(StructuredOutputsParams(json=schema))
    compiler.grammar(StructuredOutputsParams(json=json.dumps(dict(reversed(list(schema.items()))))))
    compiler.grammar(StructuredOutputsParams(json=schema, disable_any_whitespace=False))  # another grammar
    assert len(calls) == 2


def test_states_of_one_grammar_walk_independently(compiler, tokenizer):
    """Each sequence's state is a copy of the cached start: advancing one moves neither the others nor the start."""
    params = StructuredOutputsParams(choice=["alpha", "beta"])
    first, second = compiler.state(params), compiler.state(params)
    alpha, beta = (tokenizer.encode(word, add_special_tokens=False) for word in ("alpha", "beta"))
    for token in alpha:
        assert first.accept(token)
    assert first.accept(tokenizer.eos_token_id) and first.finished
    for token in beta:  # untouched by the first (finished after "alpha"): still at the start
        assert second.accept(token)
    assert compiler.state(params).accept(alpha[0])  # a new state starts at the start too


def test_a_verify_rows_mask_follows_the_drafts_before_it(compiler, tokenizer):
    """fill_masks with drafts gives the mask of the state those drafts lead to, and leaves the state where it was; a
    draft the grammar refuses leaves the row unmasked (its token is never kept)."""
    params = StructuredOutputsParams(json=SCHEMA)
    drafts = tokenizer.encode('{"name":"', add_special_tokens=False)
    state, advanced = compiler.state(params), compiler.state(params)
    for token in drafts:
        assert advanced.accept(token)
    want = allowed(advanced)
    mask = torch.zeros(2, state.width, dtype=torch.int32)
    fill_masks([state], mask[:1], [drafts])
    assert torch.equal(allowed_tokens(mask, VOCAB)[0], want)
    assert not torch.equal(want, allowed(state))  # the row's mask differs from the state's own
    assert torch.equal(allowed(state), allowed(compiler.state(params)))  # rolled back to the start
    refused = tokenizer.encode("nope", add_special_tokens=False)
    mask[1] = -1
    fill_masks([state], mask[1:], [refused])
    assert bool((mask[1] == -1).all())  # unmasked


def test_a_steps_rows_fill_in_parallel_as_each_would_alone(compiler, tokenizer):
    """One fill of many rows (several grammars, states at different places, a speculative request's rows at each
    draft position on one state) writes each row as the state alone would, and leaves every state where it was."""
    params = [
        StructuredOutputsParams(json=SCHEMA),
        StructuredOutputsParams(regex="[a-z ]+"),
        StructuredOutputsParams(choice=["alpha", "beta"]),
    ]
    states = [compiler.state(p) for p in params for _ in range(3)]
    prefixes = ['{"name":"A', "hello wor", "al"]
    for k, state in enumerate(states):  # the second and third state of each grammar part-way through
        for token in tokenizer.encode(prefixes[k // 3], add_special_tokens=False)[: k % 3 * 2]:
            assert state.accept(token)
    speculative = compiler.state(params[0])
    drafts = tokenizer.encode('{"name":"Bo', add_special_tokens=False)
    rows = states + [speculative] * (len(drafts) + 1)
    row_drafts = [[]] * len(states) + [drafts[:n] for n in range(len(drafts) + 1)]
    before = [allowed(state) for state in states]
    mask = torch.full((len(rows), states[0].width), -1, dtype=torch.int32)
    fill_masks(rows, mask, row_drafts)
    got = allowed_tokens(mask, VOCAB)
    for k in range(len(states)):
        assert torch.equal(got[k], before[k]), k
    walker = compiler.state(params[0])
    for n in range(len(drafts) + 1):
        assert torch.equal(got[len(states) + n], allowed(walker)), n
        if n < len(drafts):
            assert walker.accept(drafts[n])
    assert torch.equal(allowed(speculative), allowed(compiler.state(params[0])))  # rolled back
    assert len({tuple(row.nonzero().flatten().tolist()[:50]) for row in got}) > 4  # the rows differ
