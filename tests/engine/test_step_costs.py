"""Verify steps' measured costs for adaptive verification: the StepCostTable contract type, core's default step
timer, and the engine's start-up profiling (its steps' sizes, the table it gives the scheduler, and caches that
still give plain decoding's output afterwards)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from deepinfer_core.backend import StepCostTable, StepTimer, WallClockStepTimer, _steps
from deepinfer_core.engine.llm import LLM
from deepinfer_core.engine.scheduler import SchedulerConfig
from deepinfer_core.engine.step_costs import MAX_PROFILED_TOKENS, profiled_token_counts
from deepinfer_core.sampling.params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py

LOOP = [5, 6, 7, 8, 9] * 6  # a prompt that repeats: prompt lookup drafts from it
ADAPTIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "verify": "adaptive"}


# ---- StepCostTable -----------------------------------------------------------------------------------


def test_the_table_interpolates_between_and_extrapolates_past_its_points():
    table = StepCostTable((2, 4, 8), (1.0, 2.0, 2.5))
    assert table.cost(1) == table.cost(2) == 1.0  # flat below the first point
    assert table.cost(3) == pytest.approx(1.5)
    assert table.cost(4) == 2.0
    assert table.cost(6) == pytest.approx(2.25)
    assert table.cost(16) == pytest.approx(3.5)  # along the last segment: 0.125 s a token
    assert StepCostTable((4,), (2.0,)).cost(8) == pytest.approx(4.0)  # one point: proportional past it


def test_the_table_never_falls_as_tokens_grow():
    table = StepCostTable((1, 2, 4, 8, 16), (3.0, 2.0, 4.0, 3.5, 5.0))  # noisy measurements
    assert table.seconds == (3.0, 3.0, 4.0, 4.0, 5.0)  # their running maximum
    costs = [table.cost(t) for t in range(0, 40)]
    assert costs == sorted(costs) and costs[-1] > costs[0]


def test_the_table_logs_as_json_and_milliseconds():
    table = StepCostTable((1, 8), (0.002, 0.004))
    assert json.loads(table.to_json()) == {"tokens": [1, 8], "seconds": [0.002, 0.004]}
    assert repr(table) == "StepCostTable(1: 2 ms, 8: 4 ms)"


@pytest.mark.parametrize(
    "tokens, seconds, message",
    [
        ((), (), "at least one"),
        ((1, 2), (1.0,), "2 token counts and 1 times"),
        ((2, 2), (1.0, 1.0), "strictly increasing"),
        ((4, 2), (1.0, 1.0), "strictly increasing"),
        ((0, 2), (1.0, 1.0), "of 1 or more"),
        ((1.5, 2), (1.0, 1.0), "integers"),
        ((1, 2), (1.0, -1.0), "finite seconds of 0 or more"),
        ((1, 2), (1.0, math.nan), "finite seconds"),
        ((1, 2), (1.0, math.inf), "finite seconds"),
    ],
)
def test_a_bad_table_is_refused_saying_why(tokens, seconds, message):
    with pytest.raises(ValueError, match=message):
        StepCostTable(tokens, seconds)


# ---- core's default step timer -----------------------------------------------------------------------


def test_the_default_timer_runs_the_step_and_reads_its_result():
    calls = []

    def step() -> torch.Tensor:
        calls.append(1)
        return torch.ones(4)

    timer = WallClockStepTimer()
    assert isinstance(timer, StepTimer)
    seconds = timer.time(step, runs=3)
    assert seconds > 0 and len(calls) == 4  # one warm-up, three timed
    with pytest.raises(ValueError, match="1 or more runs"):
        timer.time(step, runs=0)


def test_the_default_timer_takes_the_median_of_its_runs(monkeypatch):
    ticks = iter([0.0, 5.0, 10.0, 11.0, 20.0, 23.0])  # runs of 5 s, 1 s and 3 s, read from a fake clock
    monkeypatch.setattr(_steps, "perf_counter", lambda: next(ticks))
    assert WallClockStepTimer().time(lambda: torch.zeros(1), runs=3) == 3.0


def test_backends_without_a_timer_get_the_default(tiny_checkpoint):
    llm = LLM(model=tiny_checkpoint, accelerator="cpu", block_size=16, progress=False)
    assert isinstance(llm.backend.step_timer, WallClockStepTimer)


# ---- start-up profiling ------------------------------------------------------------------------------


def test_profiled_token_counts_reach_the_largest_step_of_verifies():
    """Powers of two and the top, rounded up to whole sequences of k + 1 tokens."""
    assert profiled_token_counts(SchedulerConfig(max_num_seqs=4), 3) == [4, 8, 16]
    assert profiled_token_counts(SchedulerConfig(max_num_seqs=3), 2) == [3, 6, 9]
    assert profiled_token_counts(SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=100), 3)[-1] == 100
    assert profiled_token_counts(SchedulerConfig(max_num_seqs=256), 7)[-1] == MAX_PROFILED_TOKENS
    assert profiled_token_counts(SchedulerConfig(max_num_seqs=1), 1) == [2]
    assert profiled_token_counts(SchedulerConfig(max_num_seqs=8), 0) == [1, 2, 4, 8]  # decode steps


class RecordingTimer:
    """Runs each step once and reports (tokens sampled) ms: the table then says which steps ran."""

    def __init__(self) -> None:
        self.sampled: list[int] = []

    def time(self, step, runs: int = 2) -> float:
        rows = step().shape[0]  # a verify step samples at every position: one row per token
        self.sampled.append(rows)
        return rows * 1e-3


def test_an_adaptive_engine_profiles_verify_steps_at_start_up(tiny_checkpoint, monkeypatch):
    timer = RecordingTimer()
    monkeypatch.setattr(WallClockStepTimer, "time", lambda self, step, runs=2: timer.time(step, runs))
    llm = LLM(model=tiny_checkpoint, accelerator="cpu", block_size=16, progress=False, max_num_seqs=4,
              speculative_config=ADAPTIVE)  # fmt: skip
    counts = profiled_token_counts(llm.engine.config.scheduler, 3)
    decodes = profiled_token_counts(llm.engine.config.scheduler, 0)
    table = llm.engine.scheduler.step_costs
    assert timer.sampled == decodes + counts  # each profiled step had as many tokens as its bucket says
    assert decodes == [1, 2, 4]  # one token for each of up to max_num_seqs sequences
    assert llm.engine.scheduler.decode_costs == StepCostTable(tuple(decodes), tuple(c * 1e-3 for c in decodes))
    assert table == StepCostTable(tuple(counts), tuple(c * 1e-3 for c in counts))
    assert table.tokens[-1] == 4 * (3 + 1)  # every sequence verifying all its drafts
    blocks = llm.engine.blocks
    assert blocks.num_used_blocks == 0 and not blocks._cached and blocks.prefix_queries == 0  # nothing held
    fixed = LLM(model=tiny_checkpoint, accelerator="cpu", block_size=16, progress=False, max_num_seqs=4,
                speculative_config={**ADAPTIVE, "verify": "fixed"})  # fmt: skip
    assert fixed.engine.scheduler.step_costs is None and len(timer.sampled) == len(decodes + counts)  # not profiled


@pytest.mark.parametrize("accelerator", ["cpu", "rowwise_cpu"])
def test_after_profiling_speculative_output_is_the_plain_output(tiny_checkpoint, accelerator):
    """The profiled steps wrote the caches' first blocks and sequence slots; requests that then get them read
    only what they wrote themselves. A flat table makes every draft verified, so the check does not depend on
    what the profiled table says."""
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=21, ignore_eos=True)
    prompts, params = [LOOP, LOOP[3:], [3, 4] * 20 + [11]], [greedy, seeded, greedy]

    def run(speculative):
        llm = LLM(model=tiny_checkpoint, accelerator=accelerator, block_size=16, progress=False, max_num_seqs=4,
                  speculative_config=speculative)  # fmt: skip
        if speculative is not None:
            assert llm.engine.scheduler.step_costs is not None  # profiled at start-up
            llm.engine.scheduler.step_costs = StepCostTable((1, 64), (1.0, 1.0))
            llm.engine.scheduler.decode_costs = None
        return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    want = run(None)[1]
    spec, got = run(ADAPTIVE)
    assert got == want
    assert spec.engine.spec_stats.num_accepted_tokens > 0


def test_after_profiling_a_model_with_per_sequence_caches_keeps_its_output():
    """DeepSeek-V4 (the embedded demo model): the profiled steps also wrote window rings and compressor states of
    sequence slots 0..3, the slots the requests are then given."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [list(range(30, 40)) * 4, list(range(200, 208)) * 5]  # repeats: prompt lookup drafts from them

    def run(speculative):
        llm = LLM(accelerator="cpu", progress=False, max_num_seqs=4, speculative_config=speculative)
        if speculative is not None:
            llm.engine.scheduler.step_costs = StepCostTable((1, 64), (1.0, 1.0))
            llm.engine.scheduler.decode_costs = None
        return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    spec, got = run({"method": "ngram", "num_speculative_tokens": 3, "verify": "adaptive"})
    assert got == run(None)[1]
    assert spec.engine.spec_stats.num_draft_tokens > 0


def _graph_llm(tiny_checkpoint, speculative):
    """rowwise_cpu with test_decode_graphs' stand-in capture: verify steps are padded and 'replayed'."""
    import dataclasses

    from deepinfer_core.backend.registry import discover
    from deepinfer_core.backend.resolve import resolve_backend
    from deepinfer_core.backend.selection import select_backend
    from tests.engine.test_decode_graphs import ReplayByCalling

    backend = resolve_backend(select_backend(discover(), "rowwise_cpu"), dtype=torch.float32, block_size=16)
    backend = dataclasses.replace(backend, graphs=ReplayByCalling())
    return LLM(model=tiny_checkpoint, backend=backend, progress=False, max_num_seqs=5, graph_batch_size=4,
               speculative_config=speculative)  # fmt: skip


def test_padded_verify_steps_are_profiled_by_depth(tiny_checkpoint, monkeypatch):
    """With graphs, a table per draft depth d = 1..k: steps of B sequences (up to the graphs' batch, 4 here, not
    max_num_seqs) of 1 + d tokens each, every one run with those tokens (padding adds none)."""
    timer = RecordingTimer()
    monkeypatch.setattr(WallClockStepTimer, "time", lambda self, step, runs=2: timer.time(step, runs))
    llm = _graph_llm(tiny_checkpoint, ADAPTIVE)
    scheduler = llm.engine.scheduler
    assert scheduler.padded_verify_batch == 4
    tables = scheduler.padded_costs
    assert [table.tokens for table in tables] == [(2, 4, 8), (3, 6, 12), (4, 8, 16)]  # B = 1, 2, 4
    decodes, verifies = profiled_token_counts(llm.engine.config.scheduler, 0), profiled_token_counts(
        llm.engine.config.scheduler, 3)  # fmt: skip
    assert timer.sampled == decodes + verifies + [t for table in tables for t in table.tokens]
    assert llm.engine.runner.graphs._replays, "the profiled steps did not go through the graphs"


def test_padded_steps_verify_to_the_depth_their_costs_pick(tiny_checkpoint):
    """A decode-only step within the graphs' batch is planned by depth: each request verifies min(d, offered)
    drafts, d the depth whose table gives the best rate; here depth 2's steps cost as little as depth 1's and
    depth 3's twice as much. The output stays plain decoding's."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = LLM(model=tiny_checkpoint, accelerator="rowwise_cpu", progress=False).generate(
        [LOOP, LOOP[3:]], params, use_tqdm=False)  # fmt: skip
    llm = _graph_llm(tiny_checkpoint, ADAPTIVE)
    scheduler = llm.engine.scheduler
    scheduler.acceptance.survival = lambda: [0.9, 0.8, 0.7]  # steady, whatever the run accepts
    scheduler.decode_costs = StepCostTable((1, 64), (1.0, 1.0))
    cheap, dear = StepCostTable((1, 64), (1.0, 1.0)), StepCostTable((1, 64), (2.0, 2.0))
    scheduler.padded_costs = (cheap, cheap, dear)
    verified, original = [], scheduler._plan_drafts

    def plan(scheduled):
        planned = original(scheduled)
        verified.append([len(request.draft_token_ids) for request, _ in planned])
        return planned

    scheduler._plan_drafts = plan
    got = llm.generate([LOOP, LOOP[3:]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    offered = [drafts for drafts in verified if any(drafts)]
    assert offered and all(max(drafts) <= 2 for drafts in verified)
    assert any(max(drafts) == 2 for drafts in verified)


def test_the_planner_learns_the_time_a_step_takes_beyond_its_table(tiny_checkpoint):
    """Steps that take longer than their table says (the engine's own work around the runner) raise
    step_overhead, which favours verifying more drafts a step: with a table where each depth costs 10% more than
    the one before, and acceptance falling, depth 1 is planned first; a learned second of overhead makes every
    step's cost nearly the same, and the deepest depth pays."""
    llm = _graph_llm(tiny_checkpoint, ADAPTIVE)
    scheduler = llm.engine.scheduler
    scheduler.acceptance.survival = lambda: [0.6, 0.3, 0.15]
    scheduler.decode_costs = StepCostTable((1, 64), (1.0, 1.0))
    scheduler.padded_costs = tuple(StepCostTable((1, 64), (1.0 + 0.1 * d,) * 2) for d in (1, 2, 3))
    for prompt in ([1, 2, 3, 4], [5, 6, 7, 8]):
        llm.engine.add_request(str(prompt[0]), prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    llm.engine.step()  # the prefills
    scheduler.proposer = type("Three", (), {"propose_for": lambda self, request, k: [9, 9, 9]})()

    def depth() -> int:  # the drafts verified by the deepest request of the step planned now
        return max(len(request.draft_token_ids) for request, _ in scheduler.schedule().requests)

    # rates (2 + 2 s) / cost: d 0 -> 2 / 1 = 2, d 1 -> 3.2 / 1.1 = 2.91, d 2 -> 3.8 / 1.2 = 3.17, d 3 -> 4.1 / 1.3
    # = 3.15: depth 2; with a second added to every cost: 2 / 2, 3.2 / 2.1, 3.8 / 2.2, 4.1 / 2.3 = 1.78: depth 3
    assert depth() == 2
    predicted = scheduler._predicted
    assert predicted == pytest.approx(1.2)
    for _ in range(100):  # steps that take a second more than their tables say
        scheduler._predicted = predicted
        scheduler.record_step_time(predicted + 1.0)
    assert scheduler.step_overhead == pytest.approx(1.0, abs=1e-3)
    assert depth() == 3
    scheduler.record_step_time(0.0)  # faster than the table: the overhead falls, never below 0
    assert 0.0 <= scheduler.step_overhead < 1.0
