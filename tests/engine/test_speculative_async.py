"""Speculative decoding with a draft model under asynchronous scheduling: after a step of decodes the next step is
planned before the host knows how many drafts that step accepts; it takes each request's newest token and drafts
on the device and moves its positions, slots, lengths and sampler indices there by the accepted count. The output
must be plain decoding's, token for token, greedy and seeded, eager and through (stand-in) device graphs, on V3,
V4 and V4.1 draft models, through preemption, stop tokens and max_tokens inside accepted runs; steps that need
the previous step's results on the host (min_tokens, penalties) wait for them.

Random draft weights accept almost nothing, so the drafts are replaced on the device by a table built from the
plain run (TableDrafts): the drafter still runs (its caches, its confidences); the accepted counts the pipelined
steps must follow are then real."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer_core.backend.registry import discover
from deepinfer_core.backend.resolve import resolve_backend
from deepinfer_core.backend.selection import select_backend
from deepinfer_core.engine.llm import LLM
from deepinfer_core.engine.pending import InFlightTokens
from deepinfer_core.engine.request import Request
from deepinfer_core.engine.runner import ModelRunner
from deepinfer_core.engine.scheduler import Scheduler
from deepinfer_core.sampling.params import SamplingParams
from tests.engine.test_decode_graphs import ReplayByCalling
from tests.engine.test_speculative_dspark import DSPARK
from tests.model.v41_checkpoints import write_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py

GREEDY = SamplingParams(temperature=0, max_tokens=18, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, seed=4, max_tokens=15, ignore_eos=True)
PARAMS = [GREEDY, SEEDED, dataclasses.replace(GREEDY, max_tokens=12)]
K = 3


class TableDrafts:
    """Replaces `drafter`'s drafts on the device: for a sequence whose newest token is t at position p, the drafts
    listed under (p, t), where listed (else the drafter's own). Listed: after each token of a plain run's outputs,
    the run's next (i % 4) tokens for the i-th, then wrong ones, so verify steps accept 0..3 drafts."""

    def __init__(self, drafter, prompts, plain: list[tuple[int, ...]], vocab: int, device="cpu") -> None:
        table: dict[int, list[int]] = {}
        for prompt, output in zip(prompts, plain):
            for i, token in enumerate(output):
                right = list(output[i + 1 : i + 1 + i % 4])
                table.setdefault((len(prompt) + i) * vocab + token, (right + [7, 8, 9, 10])[:K])
        keys = sorted(table)
        self.keys = torch.tensor(keys, dtype=torch.int64, device=device)
        self.values = torch.tensor([table[key] for key in keys], dtype=torch.int64, device=device)
        self.vocab, self.inner = vocab, drafter.draft
        drafter.draft = self.draft  # the runner and its draft graphs call the drafter's draft

    def draft(self, inputs, caches, k):
        out = self.inner(inputs, caches, k)
        drafts, confidence = out if isinstance(out, tuple) else (out, None)
        at = inputs.last_token_index[inputs.first_row + inputs.accepted]  # each request's newest token, in [T]
        key = (inputs.positions[at] + 1) * self.vocab + inputs.next_ids[at]
        index = torch.searchsorted(self.keys, key).clamp(max=len(self.keys) - 1)
        listed = torch.where((self.keys[index] == key)[:, None], self.values[index, :k], drafts)
        return listed if confidence is None else (listed, confidence)


def _prompts(vocab: int) -> list[list[int]]:
    return [torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 21, 9)]


def _llm(path, graphs=None, speculative=None, **kwargs) -> LLM:
    backend = resolve_backend(select_backend(discover(), "rowwise_cpu"), dtype=torch.float32, block_size=16)
    backend = dataclasses.replace(backend, graphs=graphs)
    kwargs.setdefault("num_kv_blocks", 48)
    return LLM(model=str(path), backend=backend, graph_batch_size=8 if graphs else 0,
               speculative_config=speculative, progress=False, **kwargs)  # fmt: skip


def _outputs(llm: LLM, prompts, params) -> list[tuple[int, ...]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def spy_ran_ahead(monkeypatch) -> list[int | None]:
    """Per prepared step: the most drafts accepted in flight by any of its requests (None: the host knew them all)."""
    seen = []
    prepare = ModelRunner.prepare

    def spy(self, scheduled, in_flight=None):
        batch = prepare(self, scheduled, in_flight)
        seen.append(None if batch.ahead is None else int(batch.ahead.max()))
        return batch

    monkeypatch.setattr(ModelRunner, "prepare", spy)
    return seen


def spy_pipelined(monkeypatch) -> list[list[str]]:
    """Per planned step: the requests (by id) planned while their newest token was in flight."""
    seen = []
    schedule = Scheduler.schedule

    def spy(self, unsettled=None):
        seen.append(sorted(r.request_id for r in unsettled or ()))
        return schedule(self, unsettled)

    monkeypatch.setattr(Scheduler, "schedule", spy)
    return seen


@pytest.fixture
def ran_ahead(monkeypatch):
    return spy_ran_ahead(monkeypatch)


@pytest.fixture
def pipelined(monkeypatch):
    return spy_pipelined(monkeypatch)


@pytest.fixture(scope="module")
def dspark_checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("dspark-async") / "v41", DSPARK, seed=5)


@pytest.fixture
def draft_model(request, dspark_checkpoint, hf_v4_mtp_checkpoint, mtp_checkpoint):
    method = request.param
    path, vocab = {"dspark": (dspark_checkpoint, 338), "mtp-v4": (hf_v4_mtp_checkpoint.path, 256),
                   "mtp-v3": (mtp_checkpoint, 128)}[method]  # fmt: skip
    return path, vocab, {"method": method.split("-")[0], "num_speculative_tokens": K}


def _steered(path, prompts, plain, vocab, spec, graphs=None, **kwargs) -> LLM:
    """An asynchronously scheduling engine whose drafts come from TableDrafts (built from `plain`)."""
    llm = _llm(path, graphs, spec, async_scheduling=True, **kwargs)
    assert llm.engine.async_scheduling
    TableDrafts(llm.engine.runner.drafter, prompts, plain, vocab)
    return llm


@pytest.mark.parametrize("draft_model", ["dspark", "mtp-v4", "mtp-v3"], indirect=True)
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_pipelined_verify_steps_give_the_plain_output(draft_model, graphs, ran_ahead, pipelined):
    path, vocab, spec = draft_model
    prompts = _prompts(vocab)
    plain = _outputs(_llm(path), prompts, PARAMS)
    llm = _steered(path, prompts, plain, vocab, spec, ReplayByCalling() if graphs else None)
    assert _outputs(llm, prompts, PARAMS) == plain
    assert any(pipelined), "no step was planned while its requests' drafts were in flight"
    assert any(ahead for ahead in ran_ahead if ahead), "no pipelined step ran past accepted drafts: not exercised"
    assert llm.engine.spec_stats.num_accepted_tokens > 0
    if graphs:
        assert max(q for _, q, _ in llm.engine.runner.graphs._replays) > 1, "no verify step replayed a graph"


def test_preemption_stops_and_max_tokens_while_pipelined(dspark_checkpoint, pipelined):
    """A KV budget that preempts requests whose step is in flight, a stop token and max_tokens that end requests
    inside accepted runs: plain decoding's output."""
    prompts = _prompts(338) + [list(range(40, 70))]
    params = PARAMS + [dataclasses.replace(SEEDED, max_tokens=20)]
    plain = _outputs(_llm(dspark_checkpoint), prompts, params)
    stop = plain[2][6]  # request 2 stops at its seventh token (or earlier, where the same token comes first)
    params[2] = dataclasses.replace(params[2], stop_token_ids=[stop])
    plain[2] = plain[2][: plain[2].index(stop) + 1]
    spec = {"method": "dspark", "num_speculative_tokens": K}
    llm = _steered(dspark_checkpoint, prompts, plain, 338, spec, ReplayByCalling(), num_kv_blocks=9, max_num_seqs=4)
    scheduler = llm.engine.scheduler
    preempted, original = [], scheduler._preempt
    scheduler._preempt = lambda request: (preempted.append((request, request.num_pending_tokens)), original(request))
    assert _outputs(llm, prompts, params) == plain
    assert any(pending for _, pending in preempted), "no request preempted while its step was in flight"
    assert any(pipelined) and llm.engine.spec_stats.num_accepted_tokens > 0


def test_steps_that_need_results_on_the_host_wait_for_them(dspark_checkpoint, pipelined):
    """min_tokens masks stop tokens by the output's length, known on the host only once read back: while a request
    is short of it, its step is not pipelined; past it, it is. The output is the plain one."""
    prompts = _prompts(338)[:1]
    params = [SamplingParams(temperature=0, max_tokens=18, min_tokens=10, ignore_eos=True)]
    plain = _outputs(_llm(dspark_checkpoint), prompts, params)
    spec = {"method": "dspark", "num_speculative_tokens": K}
    llm = _steered(dspark_checkpoint, prompts, plain, 338, spec)
    lengths = []  # the request's output length at each planned step
    schedule = llm.engine.scheduler.schedule

    def spy(unsettled=None):
        running = llm.engine.scheduler.running
        lengths.append(len(running[0].output_token_ids) + running[0].num_pending_tokens if running else 0)
        return schedule(unsettled)

    llm.engine.scheduler.schedule = spy
    pipelined.clear()  # the plain run's
    assert _outputs(llm, prompts, params) == plain
    assert all(length >= 10 for length, ids in zip(lengths, pipelined) if ids), "pipelined short of min_tokens"
    assert any(ids for length, ids in zip(lengths, pipelined) if length >= 10), "never pipelined past min_tokens"


def test_logprobs_samples_and_an_abort_while_pipelined(dspark_checkpoint, pipelined):
    """Logprobs (top 2) of seeded top-k samples (n = 2, one sequence each) are plain decoding's, bit for bit on
    rowwise_cpu; a request aborted while its step is in flight leaves the others as they were."""
    prompts = _prompts(338)
    sampled = SamplingParams(temperature=0.8, top_k=20, seed=7, n=2, max_tokens=14, ignore_eos=True, logprobs=2)
    params = [sampled, GREEDY, SEEDED]
    want = _llm(dspark_checkpoint).generate(prompts, params, use_tqdm=False)
    plain = [o.outputs[0].token_ids for o in want]
    llm = _steered(dspark_checkpoint, prompts, plain, 338, {"method": "dspark", "num_speculative_tokens": K},
                   ReplayByCalling())  # fmt: skip
    engine, finals = llm.engine, {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
            elif output.request_id == "2" and len(output.outputs[0].token_ids) >= 5:
                assert engine._in_flight is not None and any(pipelined), "not aborted while pipelined"
                engine.abort("2")
    assert set(finals) == {"0", "1"}  # the aborted request reports nothing more
    for got, expected in zip(finals["0"].outputs, want[0].outputs):
        assert got.token_ids == expected.token_ids
        assert [{t: lp.logprob for t, lp in g.items()} for g in got.logprobs] == [
            {t: lp.logprob for t, lp in w.items()} for w in expected.logprobs
        ]
    assert finals["1"].outputs[0].token_ids == plain[1]
    assert engine.spec_stats.num_accepted_tokens > 0


def test_a_step_is_padded_only_where_drafts_in_flight_may_all_be_accepted(dspark_checkpoint):
    """Padding a verify step writes filler past each sequence's tokens; a sequence whose drafts in flight may all be
    accepted runs that much further, so its blocks must hold the filler from there (else the step is not uniform)."""
    runner = _llm(dspark_checkpoint, ReplayByCalling(), {"method": "dspark", "num_speculative_tokens": K}).engine.runner

    def decoding(name: str, blocks: list[int], drafts: int) -> tuple[Request, int]:
        request = Request(name, None, list(range(2, 10)), GREEDY, seed=0, arrival=0)
        request.output_token_ids, request.num_pending_tokens = [11, 12], 1  # 11 tokens, the newest in flight
        request.num_computed_tokens, request.block_ids, request.draft_token_ids = 10, blocks, [0] * drafts
        return request, 1 + drafts

    verifying, alone = decoding("a", [0, 1], K), decoding("b", [2], 0)  # b: its block holds positions 0..15
    scheduled = [verifying, alone]
    assert runner._uniform_queries(scheduled) == 1 + K  # b padded to 4 tokens: positions 10..13

    def in_flight(verified: int) -> InFlightTokens:
        requests = {verifying[0]: 0, alone[0]: 1}
        zeros = torch.zeros(2, dtype=torch.int64)
        return InFlightTokens(zeros, requests, zeros, torch.zeros(2, K, dtype=torch.int64),
                              {verifying[0]: K, alone[0]: verified})  # fmt: skip

    assert runner._uniform_queries(scheduled, in_flight(2)) == 1 + K  # at most 12..15: in its block
    assert runner._uniform_queries(scheduled, in_flight(3)) is None  # up to 16: past it


class SharedPool(ReplayByCalling):
    """ReplayByCalling whose graphs hand back their outputs in one buffer per dtype, as graphs captured into one
    memory pool may place them: a replay overwrites what another graph's replay returned."""

    def __init__(self) -> None:
        super().__init__()
        self.buffers: dict[torch.dtype, torch.Tensor] = {}

    def capture(self, step):
        replay = super().capture(step)

        def shared():
            out = replay()
            buffer = self.buffers.setdefault(out.dtype, out.new_empty(1 << 20))
            return buffer[: out.numel()].view(out.shape).copy_(out)

        return shared


def test_engines_sharing_a_graph_memory_pool_interleave(dspark_checkpoint, pipelined):
    """Two pipelining engines whose graphs share one memory pool (one backend's capture), stepped in turn: what one
    step leaves for the next on the device (its drafts) must not live in graph memory another engine's replay
    overwrites. Both give the plain output."""
    prompts = _prompts(338)
    plain = _outputs(_llm(dspark_checkpoint), prompts, PARAMS)
    pool, spec = SharedPool(), {"method": "dspark", "num_speculative_tokens": K}
    engines = [_steered(dspark_checkpoint, prompts, plain, 338, spec, pool).engine for _ in range(2)]
    got = [{}, {}]
    for engine in engines:
        for i, (prompt, params) in enumerate(zip(prompts, PARAMS)):
            engine.add_request(str(i), prompt, params)
    while any(engine.has_unfinished() for engine in engines):
        for engine, outputs in zip(engines, got):
            for output in engine.step():
                outputs[int(output.request_id)] = output.outputs[0].token_ids
    assert [[g[i] for i in range(len(prompts))] for g in got] == [plain, plain]
    assert any(pipelined) and all(engine.spec_stats.num_accepted_tokens > 0 for engine in engines)


@pytest.mark.parametrize(
    "spec",
    [{"method": "ngram", "num_speculative_tokens": 2}, {"method": "dspark", "num_speculative_tokens": 2,
                                                        "acceptance": "rejection"}],
)  # fmt: skip
def test_host_side_drafts_or_rejection_schedule_synchronously(dspark_checkpoint, spec):
    llm = _llm(dspark_checkpoint, None, spec, async_scheduling=True)
    assert not llm.engine.async_scheduling
