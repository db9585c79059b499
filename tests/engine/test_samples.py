"""Several samples per request (n, best_of), vLLM's meaning: one sequence per sample under the request's
id, seeds from `SamplingParams.fan_out`, the prompt's KV shared through the prefix cache."""

from __future__ import annotations

import dataclasses

import pytest

from deepinfer_core.engine.engine import Engine, EngineConfig, RequestError
from deepinfer_core.engine.llm import LLM
from deepinfer_core.engine.scheduler import SchedulerConfig
from deepinfer_core.sampling.params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py

PROMPT = list(range(5, 41))  # 36 tokens: two full blocks of 16 to share


def sampled(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "seed": 123, "max_tokens": 8, "ignore_eos": True, **kw})


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=tiny_checkpoint, accelerator="cpu", block_size=16, progress=False)


def generate(llm: LLM, prompt, params: SamplingParams):
    [out] = llm.generate([prompt], params, use_tqdm=False)
    return out


def run_engine(engine: Engine, request_id: str, prompt, params: SamplingParams) -> list:
    """Every report of the engine until it is idle."""
    engine.add_request(request_id, prompt, params)
    reports = []
    while engine.has_unfinished():
        reports += engine.step()
    return reports


def test_n_samples_differ_repeat_and_the_first_is_the_n1_run(llm, tiny_checkpoint):
    out = generate(llm, PROMPT, sampled(n=3))
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2]
    samples = [c.token_ids for c in out.outputs]
    assert all(len(s) == 8 for s in samples) and len(set(samples)) == 3
    assert all(c.cumulative_logprob is None and c.logprobs is None for c in out.outputs)  # not asked for
    assert generate(llm, PROMPT, sampled(n=1)).outputs[0].token_ids == samples[0]
    again = LLM(model=tiny_checkpoint, accelerator="cpu", block_size=16, progress=False)
    assert [c.token_ids for c in generate(again, PROMPT, sampled(n=3)).outputs] == samples
    # each sample is its fan-out seed's own run
    for params, want in zip(sampled(n=3).fan_out(), samples):
        assert generate(again, PROMPT, params).outputs[0].token_ids == want


def test_the_samples_after_the_first_read_the_prompt_from_the_prefix_cache(llm):
    hits = llm.engine.blocks.prefix_hits
    generate(llm, [7, *PROMPT], sampled(n=3))  # a prompt not seen before
    assert llm.engine.blocks.prefix_hits - hits == 2 * 2 * 16  # samples 1 and 2: two full blocks each


def test_best_of_keeps_the_n_samples_of_highest_cumulative_logprob(llm):
    params = sampled(n=2, best_of=4, max_tokens=6)
    out = generate(llm, PROMPT, params)
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(c.cumulative_logprob is None for c in out.outputs)  # logprobs were not asked for
    # the four candidates, each run alone with its fan-out seed
    runs = [generate(llm, PROMPT, dataclasses.replace(p, logprobs=0)).outputs[0] for p in params.fan_out()]
    totals = [sum(r.token_logprobs) for r in runs]
    assert len(set(totals)) == 4
    best = sorted(range(4), key=lambda i: -totals[i])[:2]
    assert [c.token_ids for c in out.outputs] == [runs[i].token_ids for i in best]
    assert best != [0, 1]  # the draw is not the first two samples: the selection was put to the test
    # with logprobs asked for, the kept samples report their cumulative logprob, best first
    with_logprobs = generate(llm, PROMPT, sampled(n=2, best_of=4, max_tokens=6, logprobs=0))
    got = [c.cumulative_logprob for c in with_logprobs.outputs]
    assert got == pytest.approx([totals[i] for i in best], abs=1e-4)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_step_reports_deliver_every_token_once_per_index(tiny_checkpoint, async_scheduling):
    llm = LLM(
        model=tiny_checkpoint, accelerator="cpu", block_size=16, progress=False, async_scheduling=async_scheduling
    )
    free = [c.token_ids for c in generate(llm, PROMPT, sampled(n=3)).outputs]
    stop = free[1][2]  # sample 1 ends early on a stop token

    def cut(tokens):
        return tokens[: tokens.index(stop) + 1] if stop in tokens else tokens

    want = [cut(t) for t in free]
    assert len(want[1]) == 3 < max(len(w) for w in want)
    reports = run_engine(llm.engine, "stream", PROMPT, sampled(n=3, stop_token_ids=(stop,)))
    assert {r.request_id for r in reports} == {"stream"}
    assert [r.finished for r in reports] == [False] * (len(reports) - 1) + [True]
    streamed = {0: (), 1: (), 2: ()}
    for report in reports:
        indices = [c.index for c in report.outputs]
        assert indices == sorted(set(indices))
        for c in report.outputs:
            streamed[c.index] += c.new_token_ids
            assert c.token_ids == streamed[c.index]  # the delta is exactly what is new
    assert [streamed[i] for i in range(3)] == want
    final = reports[-1]
    assert [c.token_ids for c in final.outputs] == want and [c.index for c in final.outputs] == [0, 1, 2]
    ended = [c.finish_reason for r in reports[:-1] for c in r.outputs if c.index == 1 and c.finish_reason]
    assert ended == ["stop"]  # sample 1 said it ended while the others ran on


def test_abort_ends_every_sample_and_request_ids_stay_separate(llm):
    engine = llm.engine
    free_before = engine.blocks.num_free_blocks
    engine.add_request("job", PROMPT, sampled(n=3, max_tokens=40))
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("job", PROMPT, sampled())
    engine.add_request("job-1", [9, 8, 7], sampled(max_tokens=12))  # no clash with a sample of "job"
    engine.add_request("job:1", [9, 8, 7], sampled(max_tokens=12))
    for _ in range(4):
        engine.step()
    assert sum(r.request_id == "job" for r in engine.scheduler.running) == 3
    engine.abort("job")
    reports = []
    while engine.has_unfinished():
        reports += engine.step()
    assert {r.request_id for r in reports} == {"job-1", "job:1"}
    assert all(len(r.outputs[0].token_ids) == 12 for r in reports if r.finished)
    assert engine.blocks.num_free_blocks == free_before
    assert len(run_engine(engine, "job", [5, 6], sampled(max_tokens=1))) == 1  # the id is free again


class Recorder:
    def __init__(self) -> None:
        self.events, self.steps = [], []

    def on_request(self, event) -> None:
        self.events.append((event.request_id, event.kind))

    def on_step(self, stats) -> None:
        self.steps.append(stats)


def test_preempted_samples_give_the_same_tokens_and_observers_see_one_request(llm):
    params = sampled(n=4, max_tokens=40)
    roomy = generate(llm, PROMPT, params)
    recorder = Recorder()
    config = EngineConfig(num_kv_blocks=9, scheduler=SchedulerConfig(max_num_seqs=8))
    tight = Engine(llm.model, llm.backend, None, config, observers=[recorder])
    schedule = tight.scheduler.schedule
    preempted = []
    tight.scheduler.schedule = lambda *a: (step := schedule(*a), preempted.append(step.num_preempted))[0]
    reports = run_engine(tight, "tight", PROMPT, params)
    assert sum(preempted) > 0  # 4 samples of 76 tokens do not fit 9 blocks of 16 at once
    assert [c.token_ids for c in reports[-1].outputs] == [c.token_ids for c in roomy.outputs]
    assert recorder.events == [("tight", "arrived"), ("tight", "finished")]
    assert max(s.num_running for s in recorder.steps) > 1  # samples ran side by side as sequences
