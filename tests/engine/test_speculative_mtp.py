"""Speculative decoding with DeepSeek-V3's MTP layer as the drafter (model/mtp.py), on a tiny checkpoint with
one MTP layer: output identical to plain decoding (greedy, seeded, k = 1 and 3, chunked prefill); the drafts
the engine makes step by step equal those of a one-shot prefill of the same tokens (the drafter's cache
really follows the sequence through verify steps and rollbacks); the errors a wrong setup gets."""

from __future__ import annotations

import pytest

from deepinfer_core.engine.llm import LLM
from deepinfer_core.model.loader import CheckpointError
from deepinfer_core.sampling.params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py

LOOP = [5, 6, 7, 8, 9] * 6


def _llm(checkpoint, accelerator="rowwise_cpu", k: int | None = 3, **kwargs) -> LLM:
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    return LLM(model=checkpoint, accelerator=accelerator, block_size=16, progress=False, speculative_config=spec,
               **kwargs)  # fmt: skip


def _workload():
    greedy = SamplingParams(temperature=0, max_tokens=19, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=11, max_tokens=17, ignore_eos=True)
    return [LOOP, LOOP, list(range(30, 70)), [4, 3] * 9], [greedy, seeded, seeded, greedy]


@pytest.mark.parametrize("accelerator, k", [("cpu", 3), ("rowwise_cpu", 1), ("rowwise_cpu", 3)])
def test_mtp_output_is_the_plain_output(mtp_checkpoint, accelerator, k):
    prompts, params = _workload()
    want = _llm(mtp_checkpoint, accelerator, None).generate(prompts, params, use_tqdm=False)
    spec = _llm(mtp_checkpoint, accelerator, k, max_num_batched_tokens=24)  # long prompts: chunked
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = spec.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts
    assert stats.num_draft_tokens <= k * stats.num_drafts


def _trace(llm: LLM, prompt: list[int], params: SamplingParams) -> list[tuple[list[int], list[int]]]:
    """(the sequence's tokens, the drafts made for its next step) after each step of one request."""
    engine = llm.engine
    engine.add_request("traced", prompt, params)
    request = engine._requests["traced"].samples[0]
    trace = []
    while engine.has_unfinished():
        engine.step()
        if not request.finished:
            trace.append((list(request.all_token_ids), list(request.next_draft_token_ids)))
    return trace


def test_the_drafts_of_each_step_are_a_one_shot_prefills(mtp_checkpoint):
    """After every step (verify steps accepting some drafts, rolling the rest back), the drafts equal those
    a fresh engine makes from one prefill of the same tokens: the drafter's cache held exactly the sequence."""
    greedy = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    trace = _trace(_llm(mtp_checkpoint), LOOP[:23], greedy)
    assert len(trace) >= 3 and all(len(drafts) == 3 for _, drafts in trace)
    for tokens, drafts in trace:
        fresh = _llm(mtp_checkpoint, enable_prefix_caching=False)
        [(after, fresh_drafts)] = _trace(fresh, tokens[:-1], SamplingParams(temperature=0, max_tokens=2))[:1]
        assert after == tokens  # the prefill sampled the same last token
        assert fresh_drafts == drafts


def test_the_check_fails_for_a_drafter_that_skips_its_catch_up(mtp_checkpoint, monkeypatch):
    """Negative control: a drafter whose cache misses the verify steps' positions drafts differently."""
    llm = _llm(mtp_checkpoint)
    drafter, real = llm.engine.runner.drafter, llm.engine.runner.drafter.draft

    def without_catch_up(step, caches, k):  # the catch-up writes copies: the real caches never see it
        return real(step, [{name: cache.clone() for name, cache in layer.items()} for layer in caches], k)

    monkeypatch.setattr(drafter, "draft", without_catch_up)
    trace = _trace(llm, LOOP[:23], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))
    fresh = [_trace(_llm(mtp_checkpoint, enable_prefix_caching=False), t[:-1], SamplingParams(max_tokens=2,
             temperature=0))[0][1] for t, _ in trace]  # fmt: skip
    assert any(f != d for f, (_, d) in zip(fresh, trace))


def test_mtp_without_mtp_weights_or_on_the_demo_model_is_refused(tiny_checkpoint):
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers = 0"):
        _llm(tiny_checkpoint)
    with pytest.raises(CheckpointError, match="the embedded demo model"):
        LLM(accelerator="cpu", progress=False, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
