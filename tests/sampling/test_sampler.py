"""Sampling parameters, counter-based Gumbel noise and the reference sampler's semantics."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer_core.sampling.noise import gumbel_noise
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.sampling.sampler import SamplingBatch, TorchSampler, apply_penalties

SAMPLER = TorchSampler()


def _batch(params, seeds, prompts=None, outputs=None):
    n = len(params)
    return SamplingBatch.build(params, seeds, prompts or [[]] * n, outputs or [[]] * n)


def _sample_many(logits_row, params, num, first_seed=1000):
    """Sample `num` times from one logits row with seeds first_seed.. (one batch, one row per seed)."""
    logits = torch.as_tensor(logits_row, dtype=torch.float32)[None].expand(num, -1).contiguous()
    out = SAMPLER.sample(logits, _batch([params] * num, list(range(first_seed, first_seed + num))))
    return out.token_ids


def _softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


def _assert_matches_distribution(tokens, probs):
    """Chi-square statistic against `probs` (computed by hand), plus a few-sigma check per token."""
    n, vocab = tokens.numel(), len(probs)
    counts = torch.bincount(tokens, minlength=vocab).tolist()
    support = [i for i, p in enumerate(probs) if p > 0]
    assert all(counts[i] == 0 for i in range(vocab) if probs[i] == 0)
    chi2 = sum((counts[i] - n * probs[i]) ** 2 / (n * probs[i]) for i in support)
    dof = len(support) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 5, (chi2, counts)  # far beyond the 99.9% quantile
    for i in support:
        sigma = math.sqrt(n * probs[i] * (1 - probs[i]))
        assert abs(counts[i] - n * probs[i]) < 5 * sigma + 1, (i, counts[i], n * probs[i])


# --------------------------------------------------------------------------------------- params


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_k", -2),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", float("nan")),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("seed", -1),
        ("seed", 2**64),
        ("max_tokens", 0),
        ("logprobs", -1),
        ("logprobs", 21),
    ],
)
def test_sampling_params_rejects_bad_value_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_rejects_empty_stop_string():
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=("ok", ""))


def test_sampling_params_accepts_edge_values():
    p = SamplingParams(
        temperature=0.0,
        top_k=-1,
        top_p=1.0,
        min_p=1.0,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        seed=2**64 - 1,
        max_tokens=1,
        logprobs=20,
        stop=("x",),
    )
    assert p.greedy
    assert not SamplingParams(temperature=0.7).greedy


# ---------------------------------------------------------------------------------------- noise


def _lowbias32(x: int) -> int:
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def _gumbel_by_hand(seed: int, step: int, token: int) -> float:
    h = _lowbias32(_lowbias32(_lowbias32(_lowbias32(seed >> 32) ^ (seed & 0xFFFFFFFF)) ^ step) ^ token)
    u = (h + 0.5) / 2**32
    return -math.log(-math.log(u))


def test_gumbel_noise_follows_documented_formula():
    # 512 values: several hit the int64 wrap-around of the second multiply in the tensor version
    seeds, steps = [0, 1, 123456789, 2**40 + 7, 2**32 - 1, 2**62 + 5, 31337, 2**33], [0, 3, 1, 99, 2**31, 7, 0, 5]
    noise = gumbel_noise(torch.tensor(seeds), torch.tensor(steps), 64)
    expected = [[_gumbel_by_hand(s, t, v) for v in range(64)] for s, t in zip(seeds, steps)]
    torch.testing.assert_close(noise, torch.tensor(expected, dtype=torch.float32), atol=0, rtol=0)


def test_gumbel_noise_depends_only_on_seed_step_token():
    seeds, steps = torch.tensor([5, 17, 42, 9, 77]), torch.tensor([0, 4, 2, 7, 1])
    batch = gumbel_noise(seeds, steps, 32)
    alone = gumbel_noise(seeds[2:3], steps[2:3], 32)
    assert torch.equal(alone[0], batch[2])  # row 2 of a batch of 5 == the same request alone
    assert torch.equal(gumbel_noise(seeds, steps, 32), batch)  # deterministic
    assert torch.equal(gumbel_noise(seeds[2:3], steps[2:3], 12)[0], batch[2, :12])  # not on vocab size
    other_seed = gumbel_noise(torch.tensor([43]), steps[2:3], 32)[0]
    other_step = gumbel_noise(seeds[2:3], torch.tensor([3]), 32)[0]
    assert (other_seed != batch[2]).all() and (other_step != batch[2]).all()


def test_large_seeds_work_through_sampling_batch():
    seeds = [2**63, 2**64 - 1, 2**63 + 12345, 2**63 - 1]
    batch = _batch([SamplingParams(seed=s) for s in seeds], seeds, outputs=[[1, 2]] * 4)
    assert batch.seeds.dtype == torch.int64 and batch.steps.tolist() == [2, 2, 2, 2]
    noise = gumbel_noise(batch.seeds, batch.steps, 5)
    expected = [[_gumbel_by_hand(s, 2, v) for v in range(5)] for s in seeds]
    torch.testing.assert_close(noise, torch.tensor(expected, dtype=torch.float32), atol=0, rtol=0)
    assert len({tuple(r) for r in noise.tolist()}) == 4


def test_gumbel_noise_is_statistically_gumbel():
    noise = gumbel_noise(torch.arange(100), torch.zeros(100, dtype=torch.int64), 1000).double()
    assert torch.isfinite(noise).all()
    assert abs(noise.mean().item() - 0.5772156649) < 0.02  # Euler-Mascheroni; std error ~0.004
    assert abs(noise.std().item() - math.pi / math.sqrt(6)) < 0.02
    # CDF exp(-exp(-x)) at 0 is 1/e
    assert abs((noise <= 0).double().mean().item() - math.exp(-1)) < 0.01


# -------------------------------------------------------------------------------------- sampler

LOGITS16 = [0.3, 2.1, -1.0, 1.7, 0.0, 2.0, -0.5, 1.1, 0.9, -2.0, 1.5, 0.2, -0.3, 0.6, 1.9, -1.5]


def test_greedy_returns_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    out = SAMPLER.sample(logits, _batch([SamplingParams(temperature=0.0)] * 6, list(range(6))))
    assert torch.equal(out.token_ids, logits.argmax(dim=1))


def test_top_k_1_returns_argmax_at_high_temperature():
    tokens = _sample_many(LOGITS16, SamplingParams(temperature=100.0, top_k=1), 300)
    assert (tokens == 1).all()
    # without top-k, the same temperature spreads the samples (so the check above is not vacuous)
    assert _sample_many(LOGITS16, SamplingParams(temperature=100.0), 300).unique().numel() > 8


def _nucleus(probs, top_p):
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = [], 0.0
    for i in order:
        if mass >= top_p:
            break
        kept.append(i)
        mass += probs[i]
    return kept


@pytest.mark.parametrize(
    "params, allowed",
    [
        (SamplingParams(top_k=3), {1, 5, 14}),
        (SamplingParams(temperature=0.8, top_p=0.5), set(_nucleus(_softmax([x / 0.8 for x in LOGITS16]), 0.5))),
        (
            SamplingParams(min_p=0.5),
            {i for i, p in enumerate(_softmax(LOGITS16)) if p >= 0.5 * max(_softmax(LOGITS16))},
        ),
    ],
)
def test_filters_never_sample_a_filtered_token(params, allowed):
    assert 1 < len(allowed) < 16
    tokens = set(_sample_many(LOGITS16, params, 600).tolist())
    assert tokens <= allowed
    assert len(tokens) > 1  # it does sample, not just take the argmax


def test_temperature_sampling_matches_softmax():
    logits = [0.5, -0.3, 1.2, 0.0, -1.0, 0.8, 0.3, -0.5]
    for temperature in (0.7, 1.5):
        tokens = _sample_many(logits, SamplingParams(temperature=temperature), 4000)
        _assert_matches_distribution(tokens, _softmax([x / temperature for x in logits]))


def test_temperature_check_can_fail():
    logits = [0.5, -0.3, 1.2, 0.0, -1.0, 0.8, 0.3, -0.5]
    tokens = _sample_many(logits, SamplingParams(temperature=0.7), 4000)
    with pytest.raises(AssertionError):  # the wrong temperature is detected
        _assert_matches_distribution(tokens, _softmax([x / 1.0 for x in logits]))


def test_top_p_distribution_is_renormalised_nucleus():
    logits = [0.5, -0.3, 1.2, 0.0, -1.0, 0.8, 0.3, -0.5]
    probs = _softmax(logits)
    kept = _nucleus(probs, 0.7)
    assert 1 < len(kept) < 8
    mass = sum(probs[i] for i in kept)
    expected = [probs[i] / mass if i in kept else 0.0 for i in range(8)]
    _assert_matches_distribution(_sample_many(logits, SamplingParams(top_p=0.7), 4000), expected)


def test_top_p_applies_to_top_k_renormalised_distribution():
    probs = [0.3, 0.25, 0.2, 0.1, 0.06, 0.05, 0.04]
    # top-3 renormalised: 0.3/0.75 = 0.4, then 0.333 -> cumulative 0.733 >= 0.7, so the third is cut;
    # on the raw distribution the mass before the third token would be 0.55 < 0.7 and it would stay
    params = SamplingParams(top_k=3, top_p=0.7)
    tokens = _sample_many([math.log(p) for p in probs], params, 4000)
    _assert_matches_distribution(tokens, [0.3 / 0.55, 0.25 / 0.55, 0, 0, 0, 0, 0])


def test_apply_penalties_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0], [-1.0, 3.0, 0.0, 0.0, 0.0, 1.5]])
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(repetition_penalty=1.5),
    ]
    batch = _batch(params, [1, 2], prompts=[[0, 1], [5]], outputs=[[2, 2, 3], []])
    expected = torch.tensor(
        [
            # 0: prompt, positive -> /2; 1: prompt, negative -> *2; 2: output x2 -> 0.5/2 - 0.5*2 - 0.25;
            # 3: output x1 -> -3*2 - 0.5 - 0.25; 4, 5: unseen
            [1.0, -2.0, -1.0, -6.75, 1.0, 0.0],
            # only token 5 seen (prompt): 1.5 / 1.5; -1 padding must not count as any token
            [-1.0, 3.0, 0.0, 0.0, 0.0, 1.0],
        ]
    )
    torch.testing.assert_close(apply_penalties(logits, batch), expected)


def test_penalties_steer_greedy_choice():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    plain = SAMPLER.sample(logits, _batch([SamplingParams(temperature=0)], [0], outputs=[[0]]))
    penalized = SAMPLER.sample(
        logits, _batch([SamplingParams(temperature=0, repetition_penalty=1.5)], [0], outputs=[[0]])
    )
    assert plain.token_ids.tolist() == [0] and penalized.token_ids.tolist() == [1]


def test_logprobs_are_raw_log_softmax_with_sorted_top():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(5)) * 2
    params = [
        SamplingParams(logprobs=3, repetition_penalty=1.8, temperature=0.5),
        SamplingParams(logprobs=0, top_k=2),
        SamplingParams(temperature=0, presence_penalty=1.0),
    ]
    batch = _batch(params, [7, 8, 9], prompts=[[0, 1, 2], [3], [4]], outputs=[[5], [], [6, 6]])
    assert batch.num_logprobs == 3
    out = SAMPLER.sample(logits, batch)
    rows = logits.double().tolist()
    for b, row in enumerate(rows):
        lse = math.log(sum(math.exp(x) for x in row))
        tok = int(out.token_ids[b])
        assert out.logprobs[b].item() == pytest.approx(row[tok] - lse, abs=1e-5)
        best = sorted(range(10), key=lambda i: -row[i])[:3]
        assert out.top_token_ids[b].tolist() == best
        assert out.top_logprobs[b].tolist() == pytest.approx([row[i] - lse for i in best], abs=1e-5)
        assert out.top_logprobs[b].tolist() == sorted(out.top_logprobs[b].tolist(), reverse=True)


def test_no_logprobs_gives_empty_top():
    out = SAMPLER.sample(torch.zeros(2, 5), _batch([SamplingParams()] * 2, [1, 2]))
    assert out.top_token_ids.shape == (2, 0) and out.top_logprobs.shape == (2, 0)


def test_sampled_token_is_batch_invariant():
    g = torch.Generator().manual_seed(6)
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.6, top_k=5),
        SamplingParams(top_p=0.8),
        SamplingParams(min_p=0.1, temperature=1.3),
        SamplingParams(temperature=0),
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
    ]
    n = len(params)
    seeds = [11, 2**63 + 3, 12, 13, 14, 15]
    prompts = [[1, 2, 3], [4], [], [5, 6, 7, 8, 9], [0], [10, 11]]
    outputs = [[], [3, 3], [1], [2, 4, 6], [], [10, 12, 12, 12]]
    logits = torch.randn(n, 40, generator=g) * 2
    together = SAMPLER.sample(logits, SamplingBatch.build(params, seeds, prompts, outputs)).token_ids
    for i in range(n):
        alone = SAMPLER.sample(
            logits[i : i + 1], SamplingBatch.build([params[i]], [seeds[i]], [prompts[i]], [outputs[i]])
        ).token_ids
        assert alone.item() == together[i].item()
    perm = [3, 0, 5, 1, 4, 2]
    shuffled = SAMPLER.sample(
        logits[perm],
        SamplingBatch.build(
            [params[i] for i in perm], [seeds[i] for i in perm], [prompts[i] for i in perm], [outputs[i] for i in perm]
        ),
    )
    assert shuffled.token_ids.tolist() == [together[i].item() for i in perm]


def test_different_seeds_give_different_samples():
    tokens = _sample_many([0.0] * 16, SamplingParams(), 200)
    assert tokens.unique().numel() > 10  # uniform over 16 tokens: seeds do decorrelate
