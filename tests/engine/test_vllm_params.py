"""vLLM's sampling parameters in the engine: min_tokens, skip_special_tokens, stop-token text, the engine
seed (vLLM's --seed) and the rank of a sampled token outside the top logprobs."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.engine.engine import Engine, EngineConfig
from deepinfer_core.engine.llm import LLM
from deepinfer_core.sampling.params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py

SPECIAL = "<｜begin▁of▁sentence｜>"  # a special token of the DeepSeek-V4 tokenizer (not EOS)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return LLM(model=tiny_checkpoint, accelerator="cpu", block_size=16, progress=False)


@pytest.fixture(scope="module")
def demo():
    return LLM(accelerator="cpu", num_kv_blocks=16, progress=False)


def generate(llm: LLM | Engine, prompt, params: SamplingParams):
    if isinstance(llm, LLM):
        return llm.generate([prompt], params, use_tqdm=False)[0]
    llm.add_request("r", prompt, params)
    finished = []
    while llm.has_unfinished():
        finished += [o for o in llm.step() if o.finished]
    return finished[0]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **kw)


# ---- min_tokens --------------------------------------------------------------------------------


def test_min_tokens_keeps_stop_tokens_out_until_reached(tiny):
    free = generate(tiny, [5, 6, 7], greedy(max_tokens=6, ignore_eos=True, logprobs=2)).outputs[0]
    stop = free.token_ids[0]  # greedy picks it first: a stop token id would end the output at once
    assert generate(tiny, [5, 6, 7], greedy(max_tokens=6, stop_token_ids=(stop,))).outputs[0].token_ids == (stop,)

    out = generate(tiny, [5, 6, 7], greedy(max_tokens=6, stop_token_ids=(stop,), min_tokens=3, logprobs=2))
    got = out.outputs[0]
    assert len(got.token_ids) >= 3 and stop not in got.token_ids[:3]
    runner_up = [t for t in free.top_logprobs[0] if t != stop][0]
    assert got.token_ids[0] == runner_up  # the best token once the stop token is masked
    # logprobs are the model's (vLLM's raw logprobs): the masked stop token still shows as the likeliest
    assert list(got.top_logprobs[0]) == list(free.top_logprobs[0])
    assert got.token_logprobs[0] == pytest.approx(free.top_logprobs[0][runner_up], abs=1e-5)
    for position in range(3):  # every masked step took the best token that is not the stop token
        assert got.token_ids[position] == [t for t in got.top_logprobs[position] if t != stop][0]
    if stop in got.token_ids:  # from the fourth token on, it ends the output again
        assert got.token_ids[-1] == stop and (got.finish_reason, got.stop_reason) == ("stop", stop)


def test_min_tokens_masks_eos_too(tiny):
    free = generate(tiny, [5, 6, 7], greedy(max_tokens=4, ignore_eos=True)).outputs[0]
    eos = free.token_ids[0]
    tiny.engine.eos_token_ids = frozenset({eos})
    try:
        assert generate(tiny, [5, 6, 7], greedy(max_tokens=4)).outputs[0].token_ids == (eos,)
        out = generate(tiny, [5, 6, 7], greedy(max_tokens=4, min_tokens=2)).outputs[0]
    finally:
        tiny.engine.eos_token_ids = frozenset({1})
    assert len(out.token_ids) >= 2 and eos not in out.token_ids[:2]


def test_stop_strings_are_not_checked_before_min_tokens(demo):
    free = generate(demo, "The cat", greedy(max_tokens=5)).outputs[0]
    pieces = [demo.tokenizer.decode([t]) for t in free.token_ids]
    stop = pieces[1]
    assert pieces[3] == stop and pieces[0] != stop  # the demo's greedy continuation repeats a word
    early = generate(demo, "The cat", greedy(max_tokens=5, stop=(stop,))).outputs[0]
    assert early.text == pieces[0] and len(early.token_ids) == 2
    late = generate(demo, "The cat", greedy(max_tokens=5, stop=(stop,), min_tokens=3)).outputs[0]
    assert late.text == "".join(pieces[:3]) and len(late.token_ids) == 4
    assert (late.finish_reason, late.stop_reason) == ("stop", stop)


# ---- skip_special_tokens -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def forcing_special(demo):
    """An engine on the demo model whose second generated token is always the special token SPECIAL."""
    [special] = demo.tokenizer.encode(SPECIAL)

    def force(prompt_ids, output_ids, row):
        return row.index_fill(0, torch.tensor([special]), 1e4) if len(output_ids) == 1 else row

    engine = Engine(demo.model, demo.backend, demo.tokenizer, EngineConfig(num_kv_blocks=8), [force])
    return engine, special


def test_skip_special_tokens_decides_whether_special_tokens_are_text(demo, forcing_special):
    engine, special = forcing_special
    skipped = generate(engine, "The cat", greedy(max_tokens=3, logprobs=0)).outputs[0]
    kept = generate(engine, "The cat", greedy(max_tokens=3, skip_special_tokens=False)).outputs[0]
    assert skipped.token_ids == kept.token_ids and skipped.token_ids[1] == special
    first, third = (demo.tokenizer.decode([t]) for t in skipped.token_ids[::2])
    assert skipped.text == first + third
    assert kept.text == first + SPECIAL + third
    assert skipped.logprobs[1][special].decoded_token == SPECIAL  # logprobs spell special tokens out (as vLLM)


def test_a_stop_tokens_text_stays_out_of_the_output(demo, forcing_special):
    engine, special = forcing_special
    out = generate(engine, "The cat", greedy(max_tokens=3, skip_special_tokens=False, stop_token_ids=(special,)))
    got = out.outputs[0]
    assert got.token_ids[1] == special and len(got.token_ids) == 2
    assert got.text == demo.tokenizer.decode(got.token_ids[:1])
    assert (got.finish_reason, got.stop_reason) == ("stop", special)


# ---- the engine seed ---------------------------------------------------------------------------


def test_the_engine_seed_makes_unseeded_requests_repeat(tiny, tiny_checkpoint):
    unseeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, n=2)

    def samples(seed):
        engine = Engine(tiny.model, tiny.backend, None, EngineConfig(num_kv_blocks=16, seed=seed))
        return [c.token_ids for c in generate(engine, [5, 6, 7], unseeded).outputs]

    first = samples(5)
    assert samples(5) == first
    assert samples(6) != first
    assert samples(None) != samples(None)  # system randomness: two unseeded engines differ
    llm = LLM(model=tiny_checkpoint, accelerator="cpu", block_size=16, progress=False, seed=5)
    assert [c.token_ids for c in generate(llm, [5, 6, 7], unseeded).outputs] == first


# ---- ranks ---------------------------------------------------------------------------------------


def test_a_sampled_token_outside_the_top_logprobs_has_a_rank(tiny):
    params = SamplingParams(temperature=5.0, seed=3, max_tokens=12, ignore_eos=True, logprobs=1)
    got = generate(tiny, [5, 6, 7], params).outputs[0]
    ranks = [entry[token].rank for entry, token in zip(got.logprobs, got.token_ids)]
    assert all(isinstance(r, int) and r >= 1 for r in ranks)
    for entry, token, top in zip(got.logprobs, got.token_ids, got.top_logprobs):
        [(best, best_logprob)] = top.items()
        assert entry[best].rank == 1
        if token != best:
            assert entry[token].rank > 1 and entry[token].logprob < best_logprob
    assert max(ranks) > 1  # at temperature 5 some sampled tokens are not the most likely


# ---- streamed text and stop strings ---------------------------------------------------------------


def test_streamed_text_never_holds_the_start_of_a_stop_string(demo):
    free = generate(demo, "The cat", greedy(max_tokens=5)).outputs[0]
    pieces = [demo.tokenizer.decode([t]) for t in free.token_ids]
    stop = pieces[1] + pieces[2]  # two tokens' text: after the first, the text ends with the stop's start
    streamed = [o.new_text for o in demo.stream("The cat", greedy(max_tokens=5, stop=(stop,)))]
    assert "".join(streamed) == pieces[0]  # what was streamed is exactly the final text: nothing to take back
    assert all(pieces[1] not in delta for delta in streamed)
