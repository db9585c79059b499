"""Speculative decoding (ngram drafts, coupled acceptance): the output is the non-speculative output token for
token, greedy and seeded, with chunked prefill, preemption, prefix hits, min_tokens, stop tokens and max_tokens
ending inside an accepted run; and drafts really are verified and accepted (the check can fail)."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer_core.backend import StepCostTable
from deepinfer_core.engine.llm import LLM
from deepinfer_core.engine.speculative import NgramProposer, SpeculativeConfig, SpeculativeError, accepted_prefix
from deepinfer_core.sampling.params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
LOOP = [5, 6, 7, 8, 9] * 6  # a prompt that repeats: prompt lookup drafts from it


def _llm(checkpoint, accelerator: str, speculative=None, **kwargs) -> LLM:
    return LLM(model=checkpoint, accelerator=accelerator, block_size=16, progress=False,
               speculative_config=speculative, **kwargs)  # fmt: skip


def _workload(stop_token: int | None = None):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=21, ignore_eos=True, logprobs=2)
    prompts = [LOOP, LOOP, [3, 4] * 20 + [11], list(range(20, 60)), LOOP[:17]]
    params = [greedy, seeded, greedy, seeded, SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)]
    if stop_token is not None:  # a stop token that the run really samples, with min_tokens before it counts
        prompts.append(LOOP)
        params.append(SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_token], min_tokens=2))
    return prompts, params


def _tokens(outputs) -> list[tuple[int, ...]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("accelerator", ["cpu", "rowwise_cpu"])
def test_speculative_output_is_the_plain_output(tiny_checkpoint, accelerator):
    plain = _llm(tiny_checkpoint, accelerator)
    prompts, params = _workload()
    want = plain.generate(prompts, params, use_tqdm=False)
    greedy = want[0].outputs[0].token_ids  # the LOOP prompt's: a token first sampled after min_tokens stops it
    stop_token = next(t for i, t in enumerate(greedy) if i >= 3 and t not in greedy[:i])
    prompts, params = _workload(stop_token)
    want = plain.generate(prompts, params, use_tqdm=False)
    spec = _llm(tiny_checkpoint, accelerator, NGRAM)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert _tokens(got) == _tokens(want)
    assert got[-1].outputs[0].finish_reason == "stop" and got[-1].outputs[0].token_ids[-1] == stop_token
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in want]
    for g, w in zip(got[1].outputs[0].logprobs, want[1].outputs[0].logprobs):  # the seeded request's logprobs
        assert g.keys() == w.keys()
        if accelerator == "rowwise_cpu":  # row-invariant: a position's logits are its own whatever the step
            assert all(g[t].logprob == w[t].logprob for t in g)
    stats = spec.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0, "nothing was drafted or accepted"
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
    assert stats.mean_accepted_length > 1


def test_chunked_prefill_and_prefix_hits_keep_the_output(tiny_checkpoint):
    small = {"max_num_batched_tokens": 8, "max_num_seqs": 4}  # prompts of 17-41 tokens: chunked
    prompts, params = _workload()
    prompts, params = prompts * 2, params * 2  # the repeats hit the prefix cache
    want = _llm(tiny_checkpoint, "rowwise_cpu", **small).generate(prompts, params, use_tqdm=False)
    spec = _llm(tiny_checkpoint, "rowwise_cpu", NGRAM, **small)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert _tokens(got) == _tokens(want)
    assert spec.engine.blocks.prefix_hits > 0
    assert spec.engine.spec_stats.num_accepted_tokens > 0


def test_preemption_happens_with_drafts_and_the_output_holds(tiny_checkpoint):
    """Few KV blocks: verify steps grow requests by their drafts and the latest arrival is preempted."""
    small = {"num_kv_blocks": 7, "max_num_seqs": 3}
    prompts, params = [LOOP] * 3, [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * 3
    want = _llm(tiny_checkpoint, "rowwise_cpu", **small).generate(prompts, params, use_tqdm=False)
    spec = _llm(tiny_checkpoint, "rowwise_cpu", NGRAM, **small)
    preempted = []
    original = spec.engine.scheduler._preempt
    spec.engine.scheduler._preempt = lambda request: (preempted.append(request), original(request))
    got = spec.generate(prompts, params, use_tqdm=False)
    assert preempted, "no preemption: the test does not exercise it"
    assert _tokens(got) == _tokens(want)


def test_max_tokens_ends_inside_an_accepted_run(tiny_checkpoint):
    spec = _llm(tiny_checkpoint, "rowwise_cpu", NGRAM)
    plain = _llm(tiny_checkpoint, "rowwise_cpu")
    for max_tokens in range(1, 9):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        [got], [want] = spec.generate([LOOP], params, use_tqdm=False), plain.generate([LOOP], params, use_tqdm=False)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert len(got.outputs[0].token_ids) == max_tokens and got.outputs[0].finish_reason == "length"


# ---- pieces ------------------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_earlier_match():
    proposer = NgramProposer(1, 3)
    assert proposer.propose([1, 2, 3, 9, 1, 2, 3, 4, 1, 2, 3], 2) == [4, 1]  # the 3-gram's latest earlier match
    assert proposer.propose([1, 2, 3, 9, 1, 2, 3], 5) == [9, 1, 2, 3]  # as many as follow it
    assert proposer.propose([4, 5, 6, 5], 2) == [6, 5]  # only a 1-gram matches
    assert proposer.propose([4, 5, 6, 7], 2) == []  # nothing repeats
    assert proposer.propose([1, 1], 0) == []
    assert NgramProposer(2, 3).propose([4, 5, 6, 5], 2) == []  # a 1-gram is below min


def test_accepted_prefix():
    assert accepted_prefix([3, 4, 5], [3, 4, 5, 6]) == 3
    assert accepted_prefix([3, 4, 5], [3, 9, 5, 6]) == 1
    assert accepted_prefix([3], [2, 7]) == 0
    assert accepted_prefix([], [2]) == 0


@pytest.mark.parametrize(
    "value, message",
    [
        ("{not json", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ({"method": "ngram"}, "num_speculative_tokens must be given"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of ngram, mtp, dspark"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "integer of 1 or more"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "unknown field(s) 'draft_model'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}, "is above prompt_lookup_max"),
        ({"method": "ngram", "num_speculative_tokens": 2, "acceptance": "exact"}, "acceptance must be one of"),
    ],
)
def test_bad_configs_say_what_is_wrong(value, message):
    with pytest.raises(SpeculativeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SpeculativeConfig.parse(value)


def test_a_json_config_parses():
    config = SpeculativeConfig.parse(json.dumps(NGRAM))
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_max) == ("ngram", 3, 3)


def test_a_model_with_per_sequence_caches_and_no_rollback_is_refused():
    """DeepSeek-V4 rolls its states back (tests/engine/test_speculative_v4.py); a model that cannot is refused."""
    from types import SimpleNamespace

    from deepinfer_core.engine.speculative import check_model
    from deepinfer_core.kv.layout import CacheKind, CacheSpec

    ring = CacheSpec(CacheKind.SLIDING_WINDOW, torch.float32, 1, 8, window=4)
    model = SimpleNamespace(cache_specs=[{"window": ring}])
    with pytest.raises(SpeculativeError, match="sliding_window.*rolled back"):
        check_model(model, SpeculativeConfig.parse(NGRAM))


def test_vllm_spec_decode_metrics_follow_the_engine(tiny_checkpoint):
    from prometheus_client import generate_latest

    from deepinfer_core.serve.metrics import ServerMetrics

    spec = _llm(tiny_checkpoint, "rowwise_cpu", NGRAM)
    metrics = ServerMetrics("tiny", 256)

    def samples() -> dict[str, float]:
        metrics.observe_engine(spec.engine)
        text = generate_latest(metrics.registry).decode()
        return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#")}

    labels = 'engine="0",model_name="tiny"'
    for _ in range(2):  # counters add what the engine did since the last scrape, not all of it again
        spec.generate([LOOP], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
        got, stats = samples(), spec.engine.spec_stats
        assert got[f"vllm:spec_decode_num_drafts_total{{{labels}}}"] == stats.num_drafts > 0
        assert got[f"vllm:spec_decode_num_draft_tokens_total{{{labels}}}"] == stats.num_draft_tokens
        assert got[f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}}"] == stats.num_accepted_tokens > 0
        # fixed verification: every proposed draft is verified
        assert got[f"deepinfer:spec_decode_num_proposed_tokens_total{{{labels}}}"] == stats.num_draft_tokens
        mean = got[f"deepinfer:spec_decode_mean_accepted_length{{{labels}}}"]
        assert mean == pytest.approx(1 + stats.num_accepted_tokens / stats.num_drafts) and mean > 1
        per_position = [got.get(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{p}"}}', 0)
                        for p in range(3)]  # fmt: skip
        assert per_position == stats.accepted_per_position
        assert sum(per_position) == stats.num_accepted_tokens
        assert per_position[0] >= per_position[1] >= per_position[2]  # a draft is accepted after those before it


# ---- adaptive verification ------------------------------------------------------------------------------


def test_plan_verification_admits_slots_while_the_rate_grows():
    from deepinfer_core.engine.speculative import plan_verification

    def linear(t):  # 1 s a step plus 0.1 s a token
        return 1.0 + 0.1 * t

    # two decodes (2 base tokens): rate 2 / 1.2 = 1.67; slot 0.9 -> 2.9 / 1.3 = 2.23; 0.8 -> 3.7 / 1.4 = 2.64;
    # 0.5 -> 4.2 / 1.5 = 2.8 (the best); 0.1 -> 4.3 / 1.6 = 2.69; 0.05, 0.01: worse still
    survival = [[0.9, 0.5, 0.1], [0.8, 0.05, 0.01]]
    assert plan_verification([3, 3], survival, linear, 2) == [2, 1]
    assert plan_verification([1, 3], survival, linear, 2) == [1, 1]  # offered drafts cap it
    assert plan_verification([3, 3], survival, lambda t: 1.0, 2) == [3, 3]  # free tokens: every draft

    def steep(t):  # a token costs more than any draft can pay back
        return 1.0 + 10.0 * t

    assert plan_verification([3, 3], survival, steep, 2) == [0, 0]
    assert plan_verification([], [], linear, 5) == []

    def jump(t):  # drafts make the step run otherwise: its cost jumps at the first one, then grows slowly
        return 1.0 if t <= 2 else 3.0 + 0.01 * t

    # the first slot alone lowers the rate (2 / 1 = 2 -> 2.9 / 3.03 = 0.96); all six raise it: 7.35 / 3.08 = 2.39
    assert plan_verification([3, 3], [[0.9, 0.9, 0.9], [0.9, 0.9, 0.85]], jump, 2) == [3, 3]
    assert plan_verification([3, 3], [[0.3, 0.1, 0.05], [0.2, 0.1, 0.0]], jump, 2) == [0, 0]  # never pays


def test_padded_verification_picks_the_steps_depth():
    """Padded steps (each decode padded to the most drafts admitted: a graph-replayed verify step) cost by their
    depth d alone, so every request verifies min(d, offered): the d of the best expected tokens per second."""
    from deepinfer_core.engine.speculative import plan_verification

    def linear(t):  # 1 s a step plus 0.1 s a token
        return 1.0 + 0.1 * t

    survival = [[0.9, 0.5, 0.1], [0.8, 0.05, 0.01], [0.95, 0.9, 0.85]]
    # three decodes, t = 3 (1 + d): d 0 -> 3 / 1.3 = 2.31; 1 -> 5.65 / 1.6 = 3.53; 2 -> 7.1 / 1.9 = 3.74;
    # 3 -> 8.06 / 2.2 = 3.66
    assert plan_verification([3, 3, 3], survival, linear, 3, padded=True) == [2, 2, 2]
    assert plan_verification([1, 3, 3], survival, linear, 3, padded=True) == [1, 2, 2]  # offered caps it
    # unpadded, the same costs admit slots one by one, best first: 0.95, 0.9, 0.9, 0.85, 0.8, 0.5 (t = 9: 7.9 /
    # 1.9 = 4.16), then 0.1 lowers the rate (8 / 2 = 4)
    assert plan_verification([3, 3, 3], survival, linear, 3) == [2, 1, 3]
    assert plan_verification([3, 3, 3], survival, lambda t: 1.0 + 10.0 * t, 3, padded=True) == [0, 0, 0]
    assert plan_verification([3, 3, 3], survival, lambda t: 1.0, 3, padded=True) == [3, 3, 3]  # free tokens


def test_acceptance_estimate_counts_a_position_once_the_drafts_before_it_held():
    from deepinfer_core.engine.speculative import AcceptanceEstimate

    estimate = AcceptanceEstimate(3, prior_accepted=0.0, prior_rejected=0.0)
    estimate.record(3, 1)  # draft 1 kept, draft 2 rejected: position 3 never offered
    estimate.record(3, 3)
    estimate.record(2, 0)
    assert estimate.offered == [3, 2, 1] and estimate.accepted == [2, 1, 1]
    assert estimate.survival() == pytest.approx([2 / 3, 2 / 3 * 1 / 2, 2 / 3 * 1 / 2 * 1])
    assert AcceptanceEstimate(2).survival() == pytest.approx([0.5, 0.25])  # the Beta(1, 1) prior alone


class StepCost:
    """A step cost of tokens ** power seconds: flat (0: every token free) or steep (3: no draft pays)."""

    def __init__(self, power: int) -> None:
        self.power = power

    def cost(self, q_tokens: int, ctx_tokens: int) -> float:
        return float(q_tokens) ** self.power

    def table(self) -> StepCostTable:
        """The same cost as a table of verify steps' measured costs (what engine/step_costs.py profiles)."""
        counts = (1, 2, 4, 8, 16, 32, 64)
        return StepCostTable(counts, tuple(float(t) ** self.power for t in counts))


@pytest.mark.parametrize("power, drafts_verified", [(0, "all"), (3, "none")])
def test_adaptive_verification_follows_the_cost_and_keeps_the_output(tiny_checkpoint, power, drafts_verified):
    """The planner weighs drafts by the verify steps' table (in place of the one profiled at start-up), not by the
    backend's cost model, which here says the opposite (and sizes prefill chunks: the same in every run)."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    table, opposite = StepCost(power).table(), StepCost(3 - power)

    def run(speculative):
        llm = _llm(tiny_checkpoint, "rowwise_cpu", speculative)
        llm.engine.scheduler.cost_model, llm.engine.scheduler.step_costs = opposite, table
        llm.engine.scheduler.decode_costs = None
        return llm, llm.generate([LOOP, LOOP[3:]], params, use_tqdm=False)

    want = run(None)[1]
    adaptive, got = run({**NGRAM, "verify": "adaptive"})
    assert _tokens(got) == _tokens(want)
    stats, estimate = adaptive.engine.spec_stats, adaptive.engine.scheduler.acceptance
    if drafts_verified == "none":
        assert stats.num_draft_tokens == 0 and sum(estimate.offered) == 0
    else:  # free tokens: what fixed verification would verify
        fixed = run(NGRAM)[0]
        assert stats.num_draft_tokens == fixed.engine.spec_stats.num_draft_tokens > 0
        assert estimate.offered[0] == stats.num_drafts


def test_rejection_acceptance_keeps_greedy_output_and_accepts_sampled_drafts(tiny_checkpoint):
    """Rejection sampling gives plain decoding's distribution, not its tokens (sampling/rejection.py checks the
    distribution); greedy rows are the same tokens, and sampled rows keep drafts at their probability."""
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    sampled = SamplingParams(temperature=0.5, seed=3, max_tokens=20, ignore_eos=True)
    plain = _llm(tiny_checkpoint, "rowwise_cpu").generate([LOOP, LOOP], [greedy, sampled], use_tqdm=False)
    spec = _llm(tiny_checkpoint, "rowwise_cpu", {**NGRAM, "acceptance": "rejection"})
    got = spec.generate([LOOP, LOOP], [greedy, sampled], use_tqdm=False)
    assert got[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert len(got[1].outputs[0].token_ids) == 20
    assert spec.engine.spec_stats.num_accepted_tokens > 0


def _drive_to(llm: LLM, prompt: list[int], tokens: int):
    """Step one greedy request until it holds at least `tokens` tokens -> (request, its computed positions)."""
    engine = llm.engine
    engine.add_request("driven", prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    request = engine._requests["driven"].samples[0]
    while request.num_known_tokens < tokens:
        engine.step()
    return request


@pytest.mark.parametrize("accelerator", ["cpu", "rowwise_cpu"])
def test_caches_after_rollback_equal_a_run_that_never_drafted(tiny_checkpoint, accelerator):
    """The KV of every computed position, read through the layout, equals plain decoding's: rejected drafts
    left nothing behind that a later step reads (bitwise on the row-invariant backend)."""
    plain, spec = _llm(tiny_checkpoint, accelerator), _llm(tiny_checkpoint, accelerator, NGRAM)
    a, b = _drive_to(plain, LOOP, 52), _drive_to(spec, LOOP, 52)
    assert spec.engine.spec_stats.num_draft_tokens > spec.engine.spec_stats.num_accepted_tokens > 0  # some rejected
    computed = min(a.num_computed_tokens, b.num_computed_tokens)
    assert a.all_token_ids[:computed] == b.all_token_ids[:computed]
    layout, specs = plain.backend.kv_layout, plain.model.cache_specs

    def kv_rows(request, llm: LLM) -> list[torch.Tensor]:
        slots = torch.tensor([request.block_ids[p // 16] * 16 + p % 16 for p in range(computed)])
        return [layout.gather(c["kv"], layer["kv"], slots) for layer, c in zip(specs, llm.engine.runner.caches)]

    for got, want in zip(kv_rows(b, spec), kv_rows(a, plain)):
        if accelerator == "rowwise_cpu":
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
