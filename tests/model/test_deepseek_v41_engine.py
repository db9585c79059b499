"""DeepSeek-V4.1 through the engine: a prefix-cache hit (replayed windows, partial groups and engram look-back)
and preemption give exactly what a plain run gives.

On tiny random checkpoints whose caches are not FP8/FP4-rounded (tests/model/v41_checkpoints.py): with the
rounding, a prefix hit (which adds up its replayed tokens in another batch shape) may land a value on the
other side of a rounding step, and identical outputs could not be asked for. Parity with the reference, with
the rounding, is test_deepseek_v41_parity.py's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from deepinfer_core.engine.llm import LLM
from deepinfer_core.sampling.params import SamplingParams
from tests.model.v41_checkpoints import SCHEDULES, write_checkpoint

CASES = sorted(SCHEDULES)
BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("v41")
    return {
        name: write_checkpoint(root / name, schedule, seed=i) for i, (name, schedule) in enumerate(SCHEDULES.items())
    }


def _llm(folder: Path, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 64)
    return LLM(model=str(folder), accelerator="cpu", dtype="float32", block_size=BLOCK, progress=False, **kwargs)


def _prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 330, (n,), generator=g).tolist() for n in lengths]


def _assert_same(got, want) -> None:
    assert list(got.token_ids) == list(want.token_ids)
    torch.testing.assert_close(torch.tensor(got.token_logprobs), torch.tensor(want.token_logprobs))


def _prefix_pair() -> tuple[list[int], list[int]]:
    """Two prompts sharing 96 tokens (6 blocks); the second's last token is the first one past the hit."""
    first, tail = _prompts(9, [100, 1])
    return first, first[:96] + tail


@pytest.mark.parametrize("case", CASES)
def test_prefix_hit_matches_a_plain_run(checkpoints, case):
    llm = _llm(checkpoints[case])
    first, second = _prefix_pair()
    llm.generate([first], GREEDY)
    output = llm.generate([second], GREEDY)[0]
    assert output.num_cached_tokens == 96
    plain = _llm(checkpoints[case], enable_prefix_caching=False).generate([second], GREEDY)[0]
    _assert_same(output.outputs[0], plain.outputs[0])


@pytest.mark.parametrize("case", CASES)
def test_a_prefix_hit_without_replay_goes_wrong(checkpoints, case):
    """The replay is needed: without it the windows at the hit's end are stale and the next logits move."""
    llm = _llm(checkpoints[case])
    llm.engine.blocks.replay_tokens = 0
    first, second = _prefix_pair()
    llm.generate([first], GREEDY)
    output = llm.generate([second], GREEDY)[0]
    assert output.num_cached_tokens == 96
    plain = _llm(checkpoints[case], enable_prefix_caching=False).generate([second], GREEDY)[0].outputs[0]
    diff = (torch.tensor(output.outputs[0].token_logprobs[:1]) - torch.tensor(plain.token_logprobs[:1])).abs().max()
    assert diff > 1e-4


@pytest.mark.parametrize("case", CASES)
def test_preemption_gives_the_same_tokens_and_logprobs(checkpoints, case):
    prompts = _prompts(13, [40, 60, 25, 55])
    want = _llm(checkpoints[case]).generate(prompts, GREEDY)
    tight = _llm(checkpoints[case], num_kv_blocks=6)  # 60 + 8 tokens need 5 blocks: the others wait or are preempted
    steps = []
    schedule = tight.engine.scheduler.schedule
    tight.engine.scheduler.schedule = lambda *a: steps.append(schedule(*a)) or steps[-1]
    got = tight.generate(prompts, GREEDY)
    assert sum(step.num_preempted for step in steps) > 0
    for mine, theirs in zip(got, want):
        _assert_same(mine.outputs[0], theirs.outputs[0])


@pytest.mark.parametrize("case", CASES)
def test_decode_steps_replayed_from_graphs_match_eager_steps(checkpoints, case):
    """Decode steps planned on the device (provisional group entries, the engram look-back from the state) and
    replayed with padding rows give the eager steps' tokens and logprobs, on the batch-invariant CPU backend."""
    from deepinfer_core.backend.registry import discover
    from deepinfer_core.backend.resolve import resolve_backend
    from deepinfer_core.backend.selection import select_backend
    from tests.engine.test_decode_graphs import ReplayByCalling

    def run(graphs, graph_batch_size: int):
        backend = resolve_backend(select_backend(discover(), "rowwise_cpu"), dtype=torch.float32, block_size=BLOCK)
        backend = dataclasses.replace(backend, graphs=graphs)
        llm = LLM(model=str(checkpoints[case]), backend=backend, num_kv_blocks=64, progress=False,
                  graph_batch_size=graph_batch_size)  # fmt: skip
        params = [GREEDY, dataclasses.replace(GREEDY, max_tokens=20)]
        outputs = llm.generate(_prompts(21, [9, 30, 17]), [params[0], params[1], params[1]])
        return [(list(o.outputs[0].token_ids), o.outputs[0].token_logprobs) for o in outputs]

    capture = ReplayByCalling()
    replayed = run(capture, 8)
    assert capture.replays > 10, "decode steps did not go through the graphs"
    assert replayed == run(None, 0)
