"""Structured outputs through the engine on the embedded demo model (random weights: unconstrained, its output is
never JSON; constrained, it always is): JSON Schema, regex, choice and grammar outputs validate, several samples
each walk their own grammar, constrained and unconstrained requests share steps (asynchronous scheduling too), and
bad constraints are refused before the request runs."""

from __future__ import annotations

import json
import re

import pytest

from deepinfer import LLM, SamplingParams, StructuredOutputsParams
from deepinfer_core.errors import RequestError

SMALL = dict(accelerator="cpu", max_num_seqs=8, kv_cache_memory_bytes=32 << 20, progress=False)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
PROMPTS = ["Describe a person as JSON:", "Who is the admin?", "Give me a record."]


@pytest.fixture(scope="module")
def llm(one_torch_thread):
    return LLM(**SMALL)


def person_ok(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (
        isinstance(value, dict)
        and set(value) == {"name", "age", "role"}
        and isinstance(value["name"], str)
        and len(value["name"]) <= 6
        and type(value["age"]) is int
        and 0 <= value["age"] <= 99
        and value["role"] in ("admin", "user", "guest")
    )


def params(seed: int, **constraint) -> SamplingParams:
    wanted = StructuredOutputsParams(**constraint) if constraint else None
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=60, structured_outputs=wanted)


def test_json_schema_outputs_validate_and_unconstrained_ones_do_not(llm):
    constrained = llm.generate(PROMPTS, [params(i, json=PERSON) for i in range(len(PROMPTS))])
    for output in constrained:
        completion = output.outputs[0]
        assert person_ok(completion.text), completion.text
        assert completion.finish_reason == "stop"  # the grammar completed, then only end-of-sequence was allowed
        assert " " not in completion.text.split('"name"')[0]  # compact JSON by default
    free = llm.generate(PROMPTS, [params(i) for i in range(len(PROMPTS))])
    assert not any(person_ok(o.outputs[0].text) for o in free)  # the control: random weights never write it


def test_regex_choice_and_grammar(llm):
    phone = r"[0-9]{3}-[0-9]{4}"
    sql = 'start: "SELECT " NAME " FROM " NAME\nNAME: /[a-z]{1,8}/'
    outputs = llm.generate(
        ["Call me at", "The mood is", "Query:"],
        [params(1, regex=phone), params(2, choice=["happy", "sad", "calm"]), params(3, grammar=sql)],
    )
    texts = [o.outputs[0].text for o in outputs]
    assert re.fullmatch(phone, texts[0]), texts[0]
    assert texts[1] in ("happy", "sad", "calm"), texts[1]
    assert re.fullmatch(r"SELECT [a-z]{1,8} FROM [a-z]{1,8}", texts[2]), texts[2]


def test_each_sample_walks_its_own_grammar_beside_unconstrained_requests(llm):
    wanted = StructuredOutputsParams(json=PERSON)
    several = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=60, structured_outputs=wanted)
    outputs = llm.generate(PROMPTS, [several, params(8), params(9, json_object=True)])
    assert len(outputs[0].outputs) == 3 and all(person_ok(c.text) for c in outputs[0].outputs)
    assert not person_ok(outputs[1].outputs[0].text)
    tail = outputs[2].outputs[0]
    if tail.finish_reason == "stop":  # any JSON object: it may still be open at max_tokens
        assert isinstance(json.loads(tail.text), dict)
    else:
        assert tail.text.startswith("{")


def test_asynchronous_scheduling_pipelines_constrained_steps(one_torch_thread, monkeypatch):
    """The next step is issued before a constrained request's token is read; its mask waits for the token between
    that step's model and its sampling (LaunchedStep.advance_grammars), and the tokens are the synchronous run's."""
    from deepinfer_core.engine.pending import LaunchedStep

    advanced = []
    original = LaunchedStep.advance_grammars
    monkeypatch.setattr(LaunchedStep, "advance_grammars", lambda step: advanced.append(step) or original(step))
    llm = LLM(**SMALL, async_scheduling=True)
    assert llm.engine.async_scheduling
    outputs = llm.generate(PROMPTS, [params(i, json=PERSON) if i != 1 else params(i) for i in range(3)])
    assert len(advanced) >= 10  # most decode steps ran pipelined
    assert person_ok(outputs[0].outputs[0].text) and person_ok(outputs[2].outputs[0].text)
    synchronous = LLM(**SMALL, async_scheduling=False)
    again = synchronous.generate(PROMPTS, [params(i, json=PERSON) if i != 1 else params(i) for i in range(3)])
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in again]


@pytest.mark.parametrize(
    "constraint,needle",
    [(dict(regex="a(b"), "unclosed group"), (dict(json={"type": "objectx"}), "objectx")],
    ids=["regex", "schema"],
)
def test_a_bad_constraint_is_refused_before_it_runs(llm, constraint, needle):
    with pytest.raises(RequestError, match=needle):
        llm.generate(["x"], params(0, **constraint))
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_speculative_decoding_masks_every_draft_position(one_torch_thread, temperature):
    """With ngram drafts (coupled acceptance) a constrained request's output is the non-speculative one, token for
    token: each verify row is masked by the grammar after the drafts before it. A repeating regex makes the
    prompt-lookup drafts land, so verify steps with several constrained rows really run."""
    constraints = [dict(regex="(ab)+c"), dict(json=PERSON), None]

    def run(speculative):
        llm = LLM(**SMALL, speculative_config=speculative)
        wanted = [
            SamplingParams(temperature=temperature, seed=i, max_tokens=40,
                           structured_outputs=StructuredOutputsParams(**c) if c else None)
            for i, c in enumerate(constraints)
        ]  # fmt: skip
        outputs = llm.generate(["ababababab", PROMPTS[0], PROMPTS[1]], wanted)
        return [o.outputs[0].token_ids for o in outputs], llm.engine.spec_stats

    plain, _ = run(None)
    drafted, stats = run({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert drafted == plain
    assert stats.num_proposed_tokens > 0  # verify steps ran with masked draft rows
    if temperature == 0:  # greedy repeats one token: its drafts are kept (seeded ones are mostly rejected)
        assert stats.num_accepted_tokens > 10
    text = LLM(**SMALL).tokenizer.decode(list(plain[0]))
    assert re.fullmatch("(ab)+c?", text), text  # greedy repeats "ab" up to max_tokens; seeded ends with "c"


def test_a_failed_sampling_leaves_no_broken_step_in_flight(one_torch_thread, monkeypatch):
    """A step whose sampling fails (issued after the previous step's finalize, its masks filled in the background)
    raises once; the engine then goes on: the steps after it run, and a request added afterwards completes."""
    from deepinfer_core.structured.masks import GrammarMasks

    llm = LLM(**SMALL, async_scheduling=True)
    engine = llm.engine
    original, calls, broken = GrammarMasks.apply, [], []

    def failing(masks, sampler, logits):  # the third step's masks fail, as often as they are applied
        calls.append(1)
        if len(calls) == 3 or masks in broken:
            broken.append(masks)
            raise RuntimeError("sampling failed")
        return original(masks, sampler, logits)

    monkeypatch.setattr(GrammarMasks, "apply", failing)
    engine.add_request("first", "Describe a person as JSON:", params(0, json=PERSON))
    with pytest.raises(RuntimeError, match="sampling failed"):
        while engine.has_unfinished():
            engine.step()
    engine.abort("first")
    engine.add_request("second", "Give me a record.", params(1, json=PERSON))
    finished = []
    while engine.has_unfinished():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["second"] and person_ok(finished[0].outputs[0].text)
