"""Window snapshots (engine/snapshots.py): a prefix hit at a block boundary where an earlier request left a
snapshot restores every layer's window and per-sequence state exactly and recomputes nothing before it.

On a tiny random DeepSeek-V4.1 (the deep config of test_prefix_replay.py: its exact replay, 186 tokens, is
far longer than what a snapshot leaves to compute) and transformers' tiny DeepSeek-V4. "Exact" is checked
against a run without prefix caching: same greedy tokens, logprobs within float32 rounding (never bitwise).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer_core.engine.llm import LLM
from deepinfer_core.errors import DeepInferError
from deepinfer_core.sampling.params import SamplingParams
from tests.model.test_prefix_replay import DEEP_V41
from tests.model.v41_checkpoints import write_checkpoint

BLOCK = 16
VOCAB = 330
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py


@pytest.fixture(scope="module")
def deep_v41(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("v41-snapshots"), DEEP_V41, seed=3)


def _llm(model, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 96)
    return LLM(model=str(model), accelerator="cpu", dtype="float32", block_size=BLOCK, progress=False, **kwargs)


def _tokens(seed: int, n: int, vocab: int = VOCAB) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Recorder:
    """Every step the engine schedules and every request it admits, from now on."""

    def __init__(self, llm: LLM) -> None:
        self.steps, self.requests = [], []
        scheduler = llm.engine.scheduler
        schedule, add = scheduler.schedule, scheduler.add
        scheduler.schedule = lambda *a: self.steps.append(schedule(*a)) or self.steps[-1]
        scheduler.add = lambda r: (self.requests.append(r), add(r))[1]

    def computed(self, request) -> int:
        return sum(n for step in self.steps for r, n in step.requests if r is request)

    def step_ends(self, request) -> list[int]:
        """The positions the request's steps ended at."""
        ends, done = [], 0
        for step in self.steps:
            for r, n in step.requests:
                if r is request:
                    done += n
                    ends.append(done)
        return ends


def _assert_same(got, want) -> None:
    assert got.token_ids == want.token_ids
    torch.testing.assert_close(torch.tensor(got.token_logprobs), torch.tensor(want.token_logprobs))


def _plain(model, prompt: list[int]):
    return _llm(model, enable_prefix_caching=False).generate([prompt], GREEDY)[0].outputs[0]


@pytest.mark.parametrize("prefix_replay", ["exact", "bounded"])
def test_a_hit_at_a_prompts_last_boundary_restores_its_windows(deep_v41, prefix_replay):
    """The first prompt (261 tokens) stops one step at its last block boundary (256) and is snapshotted
    there; a second prompt sharing those 256 tokens computes only its own 5, in either replay mode, and
    matches a plain run (bounded replay alone would not: test_prefix_replay.py)."""
    llm = _llm(deep_v41, prefix_replay=prefix_replay)
    first = _tokens(1, 261)
    second = first[:256] + _tokens(2, 5)
    record = Recorder(llm)
    llm.generate([first], GREEDY)
    assert record.step_ends(record.requests[0])[:2] == [256, 261]
    assert llm.engine.snapshots.num_snapshots >= 1
    output = llm.generate([second], GREEDY)[0]
    request = record.requests[1]
    assert output.num_cached_tokens == 256 and llm.engine.snapshots.hits == 1
    assert record.computed(request) == 5 + GREEDY.max_tokens - 1  # the prompt's own 5 tokens, then decode
    assert request.window_start == 0  # the snapshot's: every ring entry is the first request's, exact
    _assert_same(output.outputs[0], _plain(deep_v41, second))


def test_a_corrupted_snapshot_changes_the_output(deep_v41):
    """Negative control: the restored windows are really what the next tokens read."""
    llm = _llm(deep_v41)
    first = _tokens(1, 261)
    second = first[:256] + _tokens(2, 5)
    llm.generate([first], GREEDY)
    for snapshot in llm.engine.snapshots._store.values():
        for state in snapshot.states.wait():
            state.mul_(-1.0)
    got = llm.generate([second], GREEDY)[0].outputs[0]
    want = _plain(deep_v41, second)
    assert (torch.tensor(got.token_logprobs) - torch.tensor(want.token_logprobs)).abs().max() > 1e-3


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_follow_up_turn_restores_the_boundary_its_decode_crossed(deep_v41, async_scheduling):
    """Multi-turn: the second prompt is the first prompt, its 20 generated tokens and a new message. The
    first request crossed the boundary at 112 while decoding (its last token there was still in flight
    under asynchronous scheduling when the snapshot was taken); the follow-up restores it."""
    llm = _llm(deep_v41, async_scheduling=async_scheduling)
    first = _tokens(3, 100)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    reply = llm.generate([first], params)[0].outputs[0].token_ids
    follow_up = first + list(reply) + _tokens(4, 7)
    record = Recorder(llm)
    output = llm.generate([follow_up], GREEDY)[0]
    assert output.num_cached_tokens == 112 and llm.engine.snapshots.hits == 1  # 119 computed: 7 full blocks
    assert record.computed(record.requests[0]) == len(follow_up) - 112 + GREEDY.max_tokens - 1
    _assert_same(output.outputs[0], _plain(deep_v41, follow_up))


def test_the_store_keeps_the_most_recently_used_within_its_budget(deep_v41):
    probe = _llm(deep_v41)
    one = probe.engine.snapshots.snapshot_bytes
    llm = _llm(deep_v41, window_snapshot_gb=2.5 * one / 2**30)  # room for two
    snapshots = llm.engine.snapshots
    prompts = [_tokens(10 + i, 40) for i in range(3)]  # 40 tokens: one snapshot each, at 32
    llm.generate(prompts[:2], GREEDY)
    assert snapshots.num_snapshots == 2 and snapshots.nbytes == 2 * one
    llm.generate([prompts[0][:32] + _tokens(20, 3)], GREEDY)  # a hit: prompt 0's snapshot is now the newest
    assert snapshots.hits == 1
    llm.generate([prompts[2]], GREEDY)
    assert snapshots.num_snapshots == 2 and snapshots.evictions == 1 and snapshots.nbytes <= 2.5 * one
    llm.generate([prompts[1][:32] + _tokens(21, 3)], GREEDY)  # prompt 1's was evicted: replayed instead ...
    assert snapshots.hits == 1 and snapshots.evictions == 2  # ... and snapshotted again, in place of prompt 0's
    llm.generate([prompts[2][:32] + _tokens(22, 3)], GREEDY)
    assert snapshots.hits == 2


def test_no_snapshots_without_a_budget_or_prefix_caching(deep_v41):
    assert _llm(deep_v41, window_snapshot_gb=0).engine.snapshots is None
    assert _llm(deep_v41, enable_prefix_caching=False).engine.snapshots is None
    with pytest.raises(DeepInferError, match=r"window_snapshot_gb \(--window-snapshot-gb\) must be a number of GiB"):
        _llm(deep_v41, window_snapshot_gb=-1)


def test_deepseek_v4_restores_a_snapshot_too(hf_v4_checkpoint):
    ckpt = hf_v4_checkpoint("a")
    llm = _llm(ckpt.path)
    first = _tokens(5, 100, 256)
    second = first[:96] + _tokens(6, 1, 256)
    llm.generate([first], GREEDY)
    record = Recorder(llm)
    output = llm.generate([second], GREEDY)[0]
    assert output.num_cached_tokens == 96 and llm.engine.snapshots.hits == 1
    assert record.computed(record.requests[0]) == 1 + GREEDY.max_tokens - 1  # no replay (28 tokens without)
    _assert_same(output.outputs[0], _plain(ckpt.path, second))


def test_a_model_without_per_sequence_caches_keeps_none(tiny_checkpoint):
    """DeepSeek-V3 reads everything from its paged blocks: nothing to snapshot, prompts are not split."""
    llm = _llm(tiny_checkpoint)
    assert llm.engine.snapshots is None
