"""Speculative decoding of DeepSeek-V4.1 with its DSpark draft layers (model/dspark.py), on a tiny random
checkpoint with two draft stages: output identical to plain decoding (greedy and seeded, fixed and adaptive
verification, chunked prefill; prefix hits, preemption, a stop token and max_tokens inside accepted runs); the
drafts and confidences the engine makes step by step equal those of a one-shot prefill of the same tokens (each
stage's ring follows the sequence through verify steps and their rejected drafts), with a negative control; the
Markov and confidence heads against their formulas; the planner verifying by the confidences; the errors a wrong
setup gets."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.backend import StepCostTable
from deepinfer_core.engine.llm import LLM
from deepinfer_core.model.loader import CheckpointError
from deepinfer_core.sampling.params import SamplingParams
from tests.model.v41_checkpoints import SCHEDULES, write_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py

DSPARK = {
    **SCHEDULES["groups_and_candidates"],
    "num_nextn_predict_layers": 2,
    "dspark_noise_token_id": 5,
    "dspark_markov_rank": 8,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 2,
}
LOOP = [40, 41, 42, 43, 44] * 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("dspark") / "v41", DSPARK, seed=5)


def _llm(checkpoint, accelerator="rowwise_cpu", k: int | None = 4, verify="fixed", **kwargs) -> LLM:
    spec = {"method": "dspark", "num_speculative_tokens": k, "verify": verify} if k else None
    kwargs.setdefault("num_kv_blocks", 64)
    return LLM(model=str(checkpoint), accelerator=accelerator, dtype="float32", block_size=16, progress=False,
               speculative_config=spec, **kwargs)  # fmt: skip


def _workload():
    greedy = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=11, max_tokens=12, ignore_eos=True)
    return [LOOP, list(range(30, 70)), [60, 61] * 9], [greedy, seeded, greedy]


@pytest.mark.parametrize("accelerator, verify", [("cpu", "fixed"), ("rowwise_cpu", "fixed"), ("cpu", "adaptive")])
def test_dspark_output_is_the_plain_output(checkpoint, accelerator, verify):
    prompts, params = _workload()
    want = _llm(checkpoint, accelerator, None).generate(prompts, params, use_tqdm=False)
    spec = _llm(checkpoint, accelerator, 4, verify, max_num_batched_tokens=24)  # long prompts: chunked
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = spec.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens <= 4 * stats.num_drafts


def _trace(llm: LLM, prompt: list[int], params: SamplingParams):
    """(the sequence's tokens, the drafts and their confidences for its next step) after each step."""
    engine = llm.engine
    engine.add_request("traced", prompt, params)
    request = engine._requests["traced"].samples[0]
    trace = []
    while engine.has_unfinished():
        engine.step()
        if not request.finished:
            trace.append((list(request.all_token_ids), list(request.next_draft_token_ids),
                          list(request.next_draft_confidence)))  # fmt: skip
    return trace


def _one_shot(checkpoint, tokens: list[int]):
    fresh = _llm(checkpoint, enable_prefix_caching=False)
    return _trace(fresh, tokens[:-1], SamplingParams(temperature=0, max_tokens=2))[0]


def test_the_drafts_of_each_step_are_a_one_shot_prefills(checkpoint):
    """After every step (verify steps keeping some drafts, writing the rejected ones into the rings' spare
    slots), drafts and confidences equal those a fresh engine makes from one prefill of the same tokens."""
    trace = _trace(_llm(checkpoint), LOOP[:23], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert len(trace) >= 3 and all(len(drafts) == 4 == len(conf) for _, drafts, conf in trace)
    for tokens, drafts, confidences in trace:
        after, fresh_drafts, fresh_confidences = _one_shot(checkpoint, tokens)
        assert after == tokens  # the prefill sampled the same last token
        assert fresh_drafts == drafts
        torch.testing.assert_close(torch.tensor(fresh_confidences), torch.tensor(confidences))
        assert all(0 < c < 1 for c in confidences)


def test_the_check_fails_for_a_drafter_that_skips_its_catch_up(checkpoint, monkeypatch):
    """Negative control: stage rings that miss the verify steps' positions draft differently."""
    llm = _llm(checkpoint)
    drafter = llm.engine.runner.drafter
    monkeypatch.setattr(drafter, "forward", lambda *args: None)  # no ring writes at all
    trace = _trace(llm, LOOP[:23], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert any(_one_shot(checkpoint, tokens)[2] != confidences for tokens, _, confidences in trace)


def test_the_heads_follow_their_formulas(checkpoint):
    """Markov head: row j's logits = head(norm(h_j)) + markov_head(markov_embed(previous token)), the previous
    token the anchor, then row j - 1's draft; confidence = sigmoid(proj([h_j, markov_embed(previous)]))."""
    drafter = _llm(checkpoint, "cpu").engine.runner.drafter
    g = torch.Generator().manual_seed(0)
    k, d = 3, drafter.config.hidden_size
    hidden, anchors = torch.randn(2 * k, d, generator=g), torch.tensor([7, 300])
    drafts, confidences = drafter.heads(hidden, anchors, k)
    model = drafter.model
    for r in range(2):
        previous = int(anchors[r])
        for j in range(k):
            h = hidden[r * k + j]
            normed = h * torch.rsqrt(h.pow(2).mean() + drafter.config.rms_norm_eps) * drafter.norm
            embedded = drafter.markov_embed[previous]
            logits = normed @ model.lm_head.T + drafter.markov_head @ embedded
            conf = torch.sigmoid(torch.cat([h, embedded]) @ drafter.confidence[0])
            assert int(drafts[r, j]) == int(logits.argmax())
            torch.testing.assert_close(confidences[r, j], conf)
            previous = int(logits.argmax())


def test_adaptive_verification_follows_the_confidences(checkpoint):
    """The planner admits a draft slot while its survival (the product of the confidences up to it) pays for
    the step time it adds: the request whose drafts the head doubts verifies none, the one it trusts all."""
    llm = _llm(checkpoint, "cpu", 4, "adaptive")
    scheduler = llm.engine.scheduler
    scheduler.decode_costs = None  # a step costs 1 + 0.3 per token, with or without drafts (not the measured)
    scheduler.step_costs = StepCostTable((1, 64), (1.3, 1.0 + 0.3 * 64))
    requests = []
    for i in range(2):
        llm.engine.add_request(str(i), LOOP[:10], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        requests.append(llm.engine._requests[str(i)].samples[0])
    llm.engine.step()  # prefills: drafts for the next step
    for request, survival in zip(requests, ([0.99, 0.99, 0.99, 0.99], [0.05, 0.2, 0.2, 0.2])):
        request.next_draft_confidence = survival
    step = scheduler.schedule()
    verified = {request.request_id: len(request.draft_token_ids) for request, _ in step.requests}
    assert (verified["0"], verified["1"]) == (4, 0)
    assert step.num_proposed_tokens == 8  # what the drafter offered, as counted for the metrics


def test_dspark_setup_errors(tmp_path):
    plain = write_checkpoint(tmp_path / "plain", SCHEDULES["groups_and_candidates"])
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers = 0"):
        _llm(plain)
    noisy = write_checkpoint(tmp_path / "noise", {**DSPARK, "dspark_noise_token_id": 100000})
    with pytest.raises(CheckpointError, match="dspark_noise_token_id 100000"):
        _llm(noisy)
    with pytest.raises(CheckpointError, match="the embedded demo model"):
        LLM(accelerator="cpu", progress=False, speculative_config={"method": "dspark", "num_speculative_tokens": 2})


def _steered_run(llm: LLM, prompts, params, plain: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    """Run `prompts` through the engine step by step -> each request's output tokens. With `plain` (each
    request's plain output), after every step each request's next drafts are replaced by plain's next 0..3
    tokens and then wrong ones: the DSpark drafter runs (its rings, catch-up and confidences) while verify
    steps accept runs long enough to end inside them."""
    engine, outputs = llm.engine, {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    preempted, original = [], engine.scheduler._preempt
    engine.scheduler._preempt = lambda request: (preempted.append(request), original(request))
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id] = list(output.outputs[0].token_ids)
        for group in engine._requests.values():
            request = group.samples[0]
            if plain is not None and request.next_draft_token_ids:
                done, want = len(request.output_token_ids), plain[request.request_id]
                request.next_draft_token_ids = (want[done : done + done % 4] + [7, 8, 9, 10])[:4]
    llm.preempted = preempted
    return outputs


def test_dspark_through_prefix_hits_preemption_stops_and_max_tokens(checkpoint):
    """Prompts sharing 32 tokens (prefix hits after the first), a KV budget that preempts, a stop token and
    max_tokens that end requests inside accepted runs: the output is plain decoding's."""
    shared = list(range(100, 132))
    prompts = [shared + [7, 8], shared + [9], shared + [10, 11, 12], LOOP[:20]]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=27, ignore_eos=True)
    params = [greedy, seeded, greedy, seeded]
    want = _steered_run(_llm(checkpoint, k=None, num_kv_blocks=10, max_num_seqs=4), prompts, params)
    stop = want["2"][6]  # request 2 stops at its seventh token (or earlier, where the same token comes first)
    params[2] = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop])
    want["2"] = want["2"][: want["2"].index(stop) + 1]
    spec = _llm(checkpoint, k=4, num_kv_blocks=10, max_num_seqs=4)
    got = _steered_run(spec, prompts, params, want)
    assert got == want
    stats = spec.engine.spec_stats
    assert stats.num_accepted_tokens > 0 and spec.preempted, "no accepted drafts or no preemption: not exercised"
    assert spec.engine.blocks.prefix_hits > 0
