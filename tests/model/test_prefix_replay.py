"""`prefix_replay` through the engine: on a prefix-cache hit DeepSeek-V4.1 (and V4) recompute every token the
windows at the hit's end depend on ("exact", the default: a plain run's outputs) or only the last
BOUNDED_REPLAY_TOKENS ("bounded": fewer tokens, logits just past the hit a little off).

V4.1 on a tiny random checkpoint (tests/model/v41_checkpoints.py) made deep enough that its exact replay,
5 x (32 - 1) + 31 = 186 tokens, exceeds the bound; V4 on transformers' tiny checkpoint, whose exact replay
(28) is below it, so there bounded is exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer_core.engine.block_manager import BOUNDED_REPLAY_TOKENS
from deepinfer_core.engine.llm import LLM
from deepinfer_core.errors import DeepInferError
from deepinfer_core.sampling.params import SamplingParams
from tests.model.v41_checkpoints import SCHEDULES, write_checkpoint

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
DEEP_V41 = {**SCHEDULES["groups_and_candidates"], "sliding_window": 32}
HIT = 256  # the shared prefix: 16 full blocks, more than the exact replay

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py


@pytest.fixture(scope="module")
def deep_v41(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("v41-deep"), DEEP_V41, seed=3)


def _llm(model: str | Path, **kwargs) -> LLM:
    """An engine that replays on every hit: no window snapshots (test_window_snapshots.py has those)."""
    kwargs.setdefault("window_snapshot_gb", 0)
    return LLM(
        model=str(model),
        accelerator="cpu",
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=64,
        progress=False,
        **kwargs,
    )


def _prefix_pair(vocab: int) -> tuple[list[int], list[int]]:
    """Two prompts sharing HIT tokens; the second's last token is the first one past the hit."""
    g = torch.Generator().manual_seed(9)
    first, tail = torch.randint(3, vocab, (HIT + 4,), generator=g).tolist(), torch.randint(3, vocab, (1,), generator=g)
    return first, first[:HIT] + tail.tolist()


def _with_hit(llm: LLM, vocab: int):
    """(the second prompt's output, the prompt tokens computed for it, its Request) after the first one ran."""
    first, second = _prefix_pair(vocab)
    llm.generate([first], GREEDY)
    steps, requests = [], []
    scheduler = llm.engine.scheduler
    schedule, add = scheduler.schedule, scheduler.add
    scheduler.schedule = lambda *a: steps.append(schedule(*a)) or steps[-1]
    scheduler.add = lambda r: (requests.append(r), add(r))[1]
    output = llm.generate([second], GREEDY)[0]
    (request,) = requests
    computed = sum(n for step in steps for r, n in step.requests if r is request)
    assert output.num_cached_tokens == HIT
    return output.outputs[0], computed - (GREEDY.max_tokens - 1), request  # less the decode steps


def _first_logprob_gap(got, want) -> float:
    return abs(got.token_logprobs[0] - want.token_logprobs[0])


def test_exact_is_the_default_and_gives_a_plain_runs_outputs(deep_v41):
    llm = _llm(deep_v41)
    assert llm.engine.config.prefix_replay == "exact"
    assert llm.model.replay_tokens == 186 > BOUNDED_REPLAY_TOKENS
    got, computed, request = _with_hit(llm, 330)
    assert request.window_start == HIT - 186 and computed == HIT + 1 - request.window_start
    plain = _llm(deep_v41, enable_prefix_caching=False).generate([_prefix_pair(330)[1]], GREEDY)[0].outputs[0]
    assert got.token_ids == plain.token_ids
    torch.testing.assert_close(torch.tensor(got.token_logprobs), torch.tensor(plain.token_logprobs))


def test_bounded_recomputes_one_block_and_lands_close_to_exact(deep_v41):
    exact, _, _ = _with_hit(_llm(deep_v41), 330)
    bounded_llm = _llm(deep_v41, prefix_replay="bounded")
    assert bounded_llm.engine.blocks.replay_tokens == BOUNDED_REPLAY_TOKENS == 128
    got, computed, request = _with_hit(bounded_llm, 330)
    assert request.window_start == HIT - 128 and computed == 128 + 1  # 58 fewer tokens than exact
    # approximate: the deeper layers' windows at the hit's end differ, so the next logits move a little
    # (here by ~5e-3; with no replay at all they move by ~0.45), but the first token is the same
    assert got.token_ids[0] == exact.token_ids[0]
    assert 1e-4 < _first_logprob_gap(got, exact) < 0.05
    no_replay = _llm(deep_v41)
    no_replay.engine.blocks.replay_tokens = 0
    assert _first_logprob_gap(got, exact) < _first_logprob_gap(_with_hit(no_replay, 330)[0], exact) / 10


def test_bounded_is_exact_where_the_models_replay_is_shorter(hf_v4_checkpoint):
    ckpt = hf_v4_checkpoint("a")
    exact, exact_computed, _ = _with_hit(_llm(ckpt.path), 256)
    llm = _llm(ckpt.path, prefix_replay="bounded")
    assert llm.engine.blocks.replay_tokens == llm.model.replay_tokens == 4 * 7
    got, computed, request = _with_hit(llm, 256)
    assert request.window_start == HIT - 28 and computed == exact_computed == 28 + 1
    assert got.token_ids == exact.token_ids
    torch.testing.assert_close(torch.tensor(got.token_logprobs), torch.tensor(exact.token_logprobs))


def test_a_wrong_prefix_replay_is_refused_before_loading():
    with pytest.raises(DeepInferError, match=r"prefix_replay \(--prefix-replay\) must be 'exact' .* or 'bounded'"):
        LLM(model="/nonexistent", prefix_replay="approximate")
