"""DeepSeek-V4 through the engine (issue 8): greedy continuations identical to transformers' generate,
prefix-cache hits with bounded replay, and preemption giving the same logits as a plain run."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.engine.llm import LLM
from deepinfer_core.sampling.params import SamplingParams

BLOCK = 16
VOCAB = 256
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py


def _llm(ckpt, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 64)
    return LLM(model=ckpt.path, accelerator="cpu", block_size=BLOCK, progress=False, **kwargs)


def _prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _record(llm: LLM) -> tuple[list, list]:
    """(every ScheduledStep, every admitted Request) of the engine from now on."""
    steps, requests = [], []
    scheduler = llm.engine.scheduler
    schedule, add = scheduler.schedule, scheduler.add
    scheduler.schedule = lambda *a: steps.append(schedule(*a)) or steps[-1]
    scheduler.add = lambda r: (requests.append(r), add(r))[1]
    return steps, requests


def _assert_same(got, want) -> None:
    assert got.token_ids == want.token_ids
    torch.testing.assert_close(torch.tensor(got.token_logprobs), torch.tensor(want.token_logprobs))
    for mine, theirs in zip(got.top_logprobs, want.top_logprobs):
        assert list(mine) == list(theirs)
        torch.testing.assert_close(torch.tensor(list(mine.values())), torch.tensor(list(theirs.values())))


@torch.no_grad()
def _hf_logprobs(hf_model, prompt, generated) -> torch.Tensor:
    """HF's logprobs [len(generated), V] for each generated token, from one forward of prompt + generated."""
    logits = hf_model(torch.tensor([prompt + list(generated)])).logits[0, len(prompt) - 1 : -1]
    return logits.float().log_softmax(dim=-1)


@pytest.mark.parametrize("variant", ["a", "b"])
def test_greedy_continuations_match_hf_generate(hf_v4_checkpoint, variant):
    """A ragged batch in prefill chunks of at most 24 tokens, two sequence slots for four requests
    (a slot is reused with the previous request's stale ring and state in it)."""
    ckpt = hf_v4_checkpoint(variant)
    prompts = _prompts(5, [3, 20, 45, 70])
    outputs = _llm(ckpt, max_num_batched_tokens=24, max_num_seqs=2).generate(prompts, GREEDY)
    for prompt, output in zip(prompts, outputs):
        got = output.outputs[0]
        with torch.no_grad():
            hf = ckpt.hf_model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)
        assert list(got.token_ids) == hf[0, len(prompt) :].tolist(), f"prompt of {len(prompt)} tokens"
        hf_logprobs = _hf_logprobs(ckpt.hf_model, prompt, got.token_ids)
        chosen = hf_logprobs.gather(1, torch.tensor(got.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(got.token_logprobs), chosen)


def _prefix_pair() -> tuple[list[int], list[int]]:
    """Two prompts sharing 96 tokens: the second hits the first's 6 full blocks and its last token is the
    first one past them, so its logits depend on every layer's window at the hit's end."""
    first, tail = _prompts(9, [100, 1])
    return first, first[:96] + tail


def _second_with_prefix_hit(ckpt, replay_tokens: int | None = None):
    llm = _llm(ckpt, window_snapshot_gb=0)  # every hit replays (test_window_snapshots.py: restoring one)
    if replay_tokens is not None:
        llm.engine.blocks.replay_tokens = replay_tokens
    first, second = _prefix_pair()
    llm.generate([first], GREEDY)
    steps, requests = _record(llm)
    output = llm.generate([second], GREEDY)[0]
    return output, steps, requests[0]


def test_prefix_hit_replays_a_bounded_window_and_matches_a_plain_run(hf_v4_checkpoint):
    ckpt = hf_v4_checkpoint("a")
    output, steps, request = _second_with_prefix_hit(ckpt)
    replay = _llm(ckpt).model.replay_tokens
    assert replay == 4 * 7  # layers x (window - 1)
    assert output.num_cached_tokens == 96
    assert request.window_start == 96 - replay  # computing starts `replay` tokens before the hit's end
    computed = sum(n for step in steps for r, n in step.requests if r is request)
    assert computed == len(request.prompt_token_ids) + 10 - 1 - request.window_start  # 68 prompt tokens saved
    plain = _llm(ckpt, enable_prefix_caching=False).generate([_prefix_pair()[1]], GREEDY)[0]
    _assert_same(output.outputs[0], plain.outputs[0])
    got = output.outputs[0]  # and transformers agrees
    hf = _hf_logprobs(ckpt.hf_model, _prefix_pair()[1], got.token_ids)
    chosen = hf.gather(1, torch.tensor(got.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(got.token_logprobs), chosen)


@pytest.mark.parametrize("short_by", [None, 7])
def test_a_prefix_hit_without_enough_replay_goes_wrong(hf_v4_checkpoint, short_by):
    """The replay is needed, and all of it: with none, or one layer's window (7 tokens) less, the
    windows rebuilt at the hit's end are wrong and so are the logits of the token right after it."""
    ckpt = hf_v4_checkpoint("a")
    replay = 0 if short_by is None else _llm(ckpt).model.replay_tokens - short_by
    output, _, _ = _second_with_prefix_hit(ckpt, replay_tokens=replay)
    assert output.num_cached_tokens == 96
    plain = _llm(ckpt, enable_prefix_caching=False).generate([_prefix_pair()[1]], GREEDY)[0].outputs[0]
    diff = (torch.tensor(output.outputs[0].token_logprobs[:1]) - torch.tensor(plain.token_logprobs[:1])).abs().max()
    assert diff > 1e-4


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_gives_the_same_tokens_and_logprobs(hf_v4_checkpoint, prefix_caching):
    ckpt = hf_v4_checkpoint("a")
    prompts = _prompts(13, [40, 60, 25, 55])
    want = _llm(ckpt, enable_prefix_caching=prefix_caching).generate(prompts, GREEDY)
    tight = _llm(ckpt, num_kv_blocks=6, enable_prefix_caching=prefix_caching)  # 70 + 10 tokens need 5 blocks
    steps, _ = _record(tight)
    got = tight.generate(prompts, GREEDY)
    assert sum(step.num_preempted for step in steps) > 0
    for mine, theirs in zip(got, want):
        _assert_same(mine.outputs[0], theirs.outputs[0])
