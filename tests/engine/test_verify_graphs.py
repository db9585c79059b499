"""Verify steps of speculative decoding replayed through `DecodeGraphs`: every sequence padded to the step's most
tokens (filler tokens that no row checks, written where rejected drafts are), the step planned on the device
(`uniform_decode`), and the drafter's reads kept from the graph. The output must be plain decoding's, token for
token, on V3 (paged caches), V4 and V4.1 (rings, compressor and engram states), with drafts that are partly right
and of varying lengths, and with the draft models (DSpark, V4's MTP) reading the target through the graph and
drafting in a graph of their own (catch-up, acceptance and drafts).

The capture is test_decode_graphs' stand-in (replay = run the step again over the same static tensors)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from deepinfer_core.backend import StepCostTable
from deepinfer_core.backend.registry import discover
from deepinfer_core.backend.resolve import resolve_backend
from deepinfer_core.backend.selection import select_backend
from deepinfer_core.engine.llm import LLM
from deepinfer_core.engine.runner import ModelRunner
from deepinfer_core.sampling.params import SamplingParams
from tests.engine.test_decode_graphs import ReplayByCalling
from tests.engine.test_speculative_dspark import DSPARK
from tests.model.v41_checkpoints import SCHEDULES, write_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py

PARAMS = [
    SamplingParams(temperature=0, max_tokens=18, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=4, max_tokens=15, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
]


def _prompts(vocab: int) -> list[list[int]]:
    return [torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 21, 9)]


class UnevenDrafts:
    """Drafts of 0..4 tokens (by how many the request has produced), the first 0..3 of them the plain run's
    continuation and the rest wrong: a step's sequences verify different numbers of drafts (padding) and keep
    some (the filler then sits past accepted tokens) or none."""

    def __init__(self, plain: dict[str, tuple[int, ...]]) -> None:
        self.plain = plain

    def propose_for(self, request, k: int) -> list[int]:
        done = len(request.output_token_ids)
        right = list(self.plain[request.request_id][done : done + k])[: done % 4]
        return (right + [7, 8, 9, 10])[: min(k, done % 5)]


def _backend(graphs):
    backend = resolve_backend(select_backend(discover(), "rowwise_cpu"), dtype=torch.float32, block_size=16)
    return dataclasses.replace(backend, graphs=graphs)


def _generate(path, prompts, graphs=None, speculative=None, proposer=None, max_num_seqs=64):
    llm = LLM(model=str(path), backend=_backend(graphs), num_kv_blocks=48, graph_batch_size=8 if graphs else 0,
              speculative_config=speculative, max_num_seqs=max_num_seqs, progress=False)  # fmt: skip
    if proposer is not None:
        llm.engine.scheduler.proposer = proposer
    scheduler = llm.engine.scheduler
    if scheduler.step_costs is not None:  # adaptive: set costs (what the CPU timed varies) under which drafts pay
        scheduler.step_costs, scheduler.decode_costs = StepCostTable((1,), (1.0,)), StepCostTable((1,), (10.0,))
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    return {o.request_id: o.outputs[0].token_ids for o in outputs}, llm


@functools.cache
def _plain(path: str, vocab: int) -> dict[str, tuple[int, ...]]:
    """Plain decoding of `_prompts(vocab)` on the checkpoint at `path`, computed once for the tests that compare
    against it (the same prompts and PARAMS each time: its output is a function of the checkpoint)."""
    return _generate(path, _prompts(vocab))[0]


@pytest.fixture
def uniform_steps(monkeypatch):
    """Records (q, the scheduled counts) of every step the runner found uniform."""
    seen = []
    original = ModelRunner._uniform_queries

    def spy(self, scheduled, in_flight=None):
        q = original(self, scheduled, in_flight)
        if q is not None:
            seen.append((q, [count for _, count in scheduled]))
        return q

    monkeypatch.setattr(ModelRunner, "_uniform_queries", spy)
    return seen


def _checkpoint(request, tmp_path_factory):
    name = request.param
    if name == "v3":
        return request.getfixturevalue("tiny_checkpoint"), 128
    if name == "v4":
        return request.getfixturevalue("hf_v4_checkpoint")("a").path, 256
    return write_checkpoint(tmp_path_factory.mktemp("v41-graphs") / name, SCHEDULES[name], seed=3), 338


@pytest.fixture(params=["v3", "v4", "groups_and_candidates"])
def checkpoint(request, tmp_path_factory):
    return _checkpoint(request, tmp_path_factory)


def test_padded_verify_steps_replay_and_give_the_plain_output(checkpoint, uniform_steps):
    path, vocab = checkpoint
    prompts = _prompts(vocab)
    plain, _ = _generate(path, prompts)
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    capture = ReplayByCalling()
    got, llm = _generate(path, prompts, capture, spec, UnevenDrafts(plain))
    assert got == plain
    graphs = llm.engine.runner.graphs
    assert {q for _, q, _ in graphs._replays} > {1}, "no verify step replayed a graph"
    padded = [(q, counts) for q, counts in uniform_steps if min(counts) < q]
    assert padded, "no verify step was padded"
    stats = llm.engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # some drafts kept, some rejected


@pytest.fixture(scope="module")
def dspark_checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("dspark-graphs") / "v41", DSPARK, seed=5)


@pytest.mark.parametrize("verify", ["fixed", "adaptive"])
def test_dspark_reads_the_target_through_the_graph(dspark_checkpoint, verify):
    prompts = _prompts(338)
    plain = _plain(str(dspark_checkpoint), 338)
    spec = {"method": "dspark", "num_speculative_tokens": 4, "verify": verify}
    # 4 sequences at most (3 requests; the graphs' batch of 4 still pads them): adaptive's start-up profiling
    # times steps up to max_num_seqs * 5 tokens, which at the default 64 took ~50 s of the test's ~55 s
    got, llm = _generate(dspark_checkpoint, prompts, ReplayByCalling(), spec, max_num_seqs=4)
    assert got == plain
    graphs = llm.engine.runner.graphs
    assert graphs._drafted.shape[1] == graphs.model.taps.shape[1]  # DSpark reads the taps
    assert set(graphs._draft_replays) == set(graphs._replays) and graphs._confidence  # drafts replayed too
    assert llm.engine.spec_stats.num_drafts > 0


def test_v4_mtp_reads_the_target_through_the_graph(hf_v4_mtp_checkpoint):
    prompts = _prompts(256)
    plain = _plain(str(hf_v4_mtp_checkpoint.path), 256)
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    got, llm = _generate(hf_v4_mtp_checkpoint.path, prompts, ReplayByCalling(), spec)
    assert got == plain
    graphs = llm.engine.runner.graphs
    assert 4 in {q for _, q, _ in graphs._replays}  # 3 drafts verified (fewer only near max_tokens)
    assert graphs._drafted.dim() == 3  # the streams V4's MTP reads
    assert set(graphs._draft_replays) == set(graphs._replays) and not graphs._confidence


def test_v3_mtp_drafts_in_a_graph(mtp_checkpoint):
    """DeepSeek-V3's MTP layer (paged caches only): the chained drafts of the draft graph, the plain output."""
    prompts = _prompts(128)
    plain = _plain(str(mtp_checkpoint), 128)
    got, llm = _generate(mtp_checkpoint, prompts, ReplayByCalling(), {"method": "mtp", "num_speculative_tokens": 3})
    assert got == plain
    graphs = llm.engine.runner.graphs
    assert 4 in {q for _, q, _ in graphs._draft_replays} and set(graphs._draft_replays) == set(graphs._replays)
    assert llm.engine.spec_stats.num_drafts > 0


def _draft_trace(llm: LLM, prompts, plain: dict[str, tuple[int, ...]]) -> list[dict]:
    """Each request's drafts and their confidences after every step of a run of `prompts`; each step then verifies
    UnevenDrafts' instead (0..3, partly the `plain` continuation's), so the drafter also drafts after accepted drafts
    (random weights' own are all rejected) and from padded steps."""
    engine, trace = llm.engine, []
    for i, (prompt, params) in enumerate(zip(prompts, PARAMS)):
        engine.add_request(str(i), prompt, params)
    steer = UnevenDrafts(plain)
    while engine.has_unfinished():
        engine.step()
        running = [(rid, group.samples[0]) for rid, group in engine._requests.items() if not group.samples[0].finished]
        trace.append({rid: (list(r.next_draft_token_ids), list(r.next_draft_confidence)) for rid, r in running})
        for _, request in running:
            if request.next_draft_token_ids:
                request.next_draft_token_ids = steer.propose_for(request, 3)  # 0..3 of them: steps are padded
    return trace


@pytest.mark.parametrize("method", ["dspark", "mtp-v4", "mtp-v3"])
def test_the_draft_graph_drafts_what_eager_steps_draft(method, dspark_checkpoint, hf_v4_mtp_checkpoint, mtp_checkpoint):
    """Step by step, the drafts (and DSpark's confidences) made in the draft graph are the eager drafter's: the
    catch-up over padded rows, the acceptance counted in the graph and the drafts from the last accepted position
    (rowwise_cpu: batch-invariant, so padding changes no bit)."""
    path, vocab = {"dspark": (dspark_checkpoint, 338), "mtp-v4": (hf_v4_mtp_checkpoint.path, 256),
                   "mtp-v3": (mtp_checkpoint, 128)}[method]  # fmt: skip
    spec = {"method": method.split("-")[0], "num_speculative_tokens": 3}
    prompts = _prompts(vocab)

    plain = _plain(str(path), vocab)

    def run(graphs):
        llm = LLM(model=str(path), backend=_backend(graphs), num_kv_blocks=48, graph_batch_size=8 if graphs else 0,
                  speculative_config=spec, progress=False)  # fmt: skip
        return _draft_trace(llm, prompts, plain), llm

    eager, _ = run(None)
    replayed, llm = run(ReplayByCalling())
    assert llm.engine.runner.graphs._draft_replays, "no draft graph ran"
    assert llm.engine.spec_stats.num_accepted_tokens > 0, "no draft accepted: drafting after accepted runs untested"
    assert [{rid: drafts for rid, (drafts, _) in step.items()} for step in replayed] == [
        {rid: drafts for rid, (drafts, _) in step.items()} for step in eager
    ]
    confidences = [[sure for _, sure in step.values()] for step in replayed]
    expected = [[sure for _, sure in step.values()] for step in eager]
    flat = [c for step in confidences for sure in step for c in sure]  # DSpark's head: a product of other shapes
    assert flat == pytest.approx([c for step in expected for sure in step for c in sure], rel=1e-4, abs=1e-6)
    assert [[len(s) for s in step] for step in confidences] == [[len(s) for s in step] for step in expected]
    assert any(drafts for step in eager for drafts, _ in step.values())
