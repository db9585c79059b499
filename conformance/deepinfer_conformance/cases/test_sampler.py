"""The backend's sampler against the semantics of deepinfer_core.sampling.sampler and core's TorchSampler.

Four groups of cases:
  * distribution: 4000 rows of the same logits, each with its own seed, in one sample call; the
    empirical token frequencies are compared with the exact distribution (softmax(logits / T),
    restricted and renormalised by top-k, top-p, min-p) by a chi-square test, and tokens outside the
    allowed set must never appear. Every backend must pass these, deterministic sampling or not.
  * determinism: the same logits and seeds give the same tokens twice; temperature 0 is the argmax.
  * identical tokens to the reference for identical logits and seeds (penalties, mixed greedy and
    sampled rows): required only of backends that claim Capabilities.deterministic_sampling.
  * logprobs: the chosen token's raw logprob and the top logprobs agree with the reference.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.sampling.sampler import SamplingBatch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def samplers(suite):
    """(backend under test, reference), resolved in a compute dtype both declare (the sampler itself
    always takes float32 logits, so any common dtype will do; float32 is preferred)."""
    common = [d for d in _DTYPES if d in suite.capabilities.dtypes and d in suite.reference.capabilities.dtypes]
    if not common:
        pytest.skip(f"{suite.under_test.name} shares no compute dtype with the reference")
    return suite.pair(_DTYPES[common[0]])


def sample(backend, logits: torch.Tensor, params, seeds, prompts=None, outputs=None, num_logprobs=None):
    """One call of `backend`'s sampler with the inputs on its device; the outputs come back on CPU."""
    rows = len(params)
    batch = SamplingBatch.build(
        params, seeds, prompts or [[]] * rows, outputs or [[]] * rows, device=backend.torch_device
    )
    if num_logprobs is not None:
        batch = dataclasses.replace(batch, num_logprobs=num_logprobs)
    out = backend.sampler.sample(logits.to(backend.torch_device), batch)
    return SimpleNamespace(
        token_ids=out.token_ids.cpu(),
        logprobs=out.logprobs.cpu(),
        top_token_ids=out.top_token_ids.cpu(),
        top_logprobs=out.top_logprobs.cpu(),
    )


def spread_seeds(count: int, salt: int = 0) -> list[int]:
    """Distinct seeds over the whole uint64 range (high and low 32-bit halves both vary)."""
    return [((i + 1 + salt * 7919) * 0x9E3779B97F4A7C15) % 2**64 for i in range(count)]


def randn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# ---------------------------------------------------------------------------------------------
# Distribution: chi-square against the exact distribution
# ---------------------------------------------------------------------------------------------

DRAWS = 4000
# 12 logits with uneven gaps (no ties), the best one not at index 0
LOGITS = torch.tensor([0.4, 1.9, -0.6, 0.95, 2.6, -1.3, 0.1, 1.35, -2.1, 0.6, 2.15, -0.2])

DISTRIBUTIONS = {
    "temperature_0.6": SamplingParams(temperature=0.6),
    "temperature_1.6": SamplingParams(temperature=1.6),
    "top_k_5": SamplingParams(temperature=1.0, top_k=5),
    "top_p_0.75": SamplingParams(temperature=1.0, top_p=0.75),
    "top_k_8_top_p_0.8": SamplingParams(temperature=1.3, top_k=8, top_p=0.8),
    "min_p_0.1": SamplingParams(temperature=1.0, min_p=0.1),
    "top_k_top_p_min_p": SamplingParams(temperature=1.4, top_k=10, top_p=0.9, min_p=0.08),
}


def exact_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the sampler must draw from, in float64, written out independently of core's code:
    softmax(logits / T); keep the top-k; on the top-k-renormalised distribution keep a token if the mass of
    the better-ranked ones is below top_p and if its probability is at least min_p times the largest."""
    probs = torch.softmax(logits.double() / params.temperature, dim=0)
    vocab = probs.numel()
    sorted_probs, order = probs.sort(descending=True)
    top_k = params.top_k if params.top_k > 0 else vocab
    in_top_k = torch.arange(vocab) < top_k
    renormed = torch.where(in_top_k, sorted_probs, 0.0)
    renormed = renormed / renormed.sum()
    mass_before = renormed.cumsum(0) - renormed
    ratio = renormed / renormed[0]
    # the test's own data must not sit on a filter boundary, where float32 rounding could go either way
    if params.top_p < 1:
        assert (mass_before[in_top_k] - params.top_p).abs().min() > 1e-3, "top_p too close to a cumulative mass"
    if params.min_p > 0:
        assert (ratio[in_top_k] - params.min_p).abs().min() > 1e-3, "min_p too close to a probability ratio"
    keep = in_top_k & (mass_before < params.top_p) & (ratio >= params.min_p)
    kept = torch.where(keep, renormed, 0.0)
    return torch.empty_like(kept).scatter_(0, order, kept / kept.sum())


def chi_square_critical(df: int, z: float = 3.090232306167813) -> float:
    """Upper critical value of chi-square with `df` degrees of freedom at p = 0.001 (z = the normal's
    0.999 quantile), by the Wilson-Hilferty approximation (slightly generous for small df)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def chi_square(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the allowed tokens; bins expecting fewer than 5 draws are pooled."""
    counts, expected = counts.double(), expected.double()
    small = expected < 5
    obs = counts[~small].tolist()
    exp = expected[~small].tolist()
    if small.any():
        obs.append(float(counts[small].sum()))
        exp.append(float(expected[small].sum()))
    statistic = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return statistic, len(obs) - 1


@pytest.mark.parametrize("name", list(DISTRIBUTIONS))
def test_sampling_distribution(suite, check, name):
    ours, _ = samplers(suite)
    params = DISTRIBUTIONS[name]
    probs = exact_distribution(LOGITS, params)
    allowed = probs > 0
    out = sample(ours, LOGITS.expand(DRAWS, -1).contiguous(), [params] * DRAWS, spread_seeds(DRAWS))

    tokens = out.token_ids
    assert tokens.shape == (DRAWS,) and tokens.dtype == torch.int64, f"token_ids {tuple(tokens.shape)}/{tokens.dtype}"
    assert bool(((tokens >= 0) & (tokens < LOGITS.numel())).all()), "token ids outside the vocabulary"
    counts = torch.bincount(tokens, minlength=LOGITS.numel())
    outside = int(counts[~allowed].sum())
    statistic, df = chi_square(counts[allowed], DRAWS * probs[allowed])
    critical = chi_square_critical(df) if df > 0 else 0.0
    check.metric(
        chi_square=round(statistic, 3),
        df=df,
        critical_p001=round(critical, 3),
        draws=DRAWS,
        allowed_tokens=int(allowed.sum()),
        draws_outside_allowed=outside,
    )
    assert outside == 0, (
        f"{outside} of {DRAWS} draws are tokens the filters exclude "
        f"(per token: {counts.tolist()}; allowed: {allowed.nonzero().flatten().tolist()})"
    )
    assert statistic <= critical, (
        f"token frequencies do not follow the expected distribution: chi-square {statistic:.1f} > {critical:.1f} "
        f"(df {df}, p=0.001). observed {counts.tolist()}, expected "
        f"{[round(x, 1) for x in (DRAWS * probs).tolist()]}"
    )


# ---------------------------------------------------------------------------------------------
# Determinism and greedy
# ---------------------------------------------------------------------------------------------

VOCAB = 512


def mixed_rows(count: int, seed: int) -> tuple[list[SamplingParams], list[list[int]], list[list[int]]]:
    """Requests mixing greedy and sampled rows, every filter and penalty, and prompts/outputs of varied length
    (so generation steps vary)."""
    gen = torch.Generator().manual_seed(seed)
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=20),
        SamplingParams(temperature=1.2, top_p=0.9),
        SamplingParams(temperature=0.9, min_p=0.05),
        SamplingParams(temperature=1.1, top_k=50, top_p=0.8, min_p=0.02),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4),
        SamplingParams(temperature=0.8, repetition_penalty=1.2, frequency_penalty=0.6),
        SamplingParams(temperature=1.0, repetition_penalty=0.8, presence_penalty=-0.7, top_k=40),
        SamplingParams(temperature=1.5, presence_penalty=1.5, frequency_penalty=-0.5, top_p=0.95),
    ]
    params, prompts, outputs = [], [], []
    for i in range(count):
        params.append(kinds[i % len(kinds)])
        prompt_len, output_len = torch.randint(0, 24, (2,), generator=gen).tolist()
        # draw from a narrow range so tokens repeat and the penalties bite
        prompts.append(torch.randint(0, 64, (prompt_len,), generator=gen).tolist())
        outputs.append(torch.randint(0, 64, (output_len,), generator=gen).tolist())
    return params, prompts, outputs


def peaked_logits(rows: int, seed: int) -> torch.Tensor:
    """Random logits whose best tokens sit among the ids the prompts/outputs use, so penalties change picks."""
    logits = randn(rows, VOCAB, seed=seed, scale=2.0)
    logits[:, :64] += 2.0
    return logits


def test_seeded_sampling_is_reproducible(suite, check):
    ours, _ = samplers(suite)
    params, prompts, outputs = mixed_rows(200, seed=21)
    logits = peaked_logits(200, seed=22)
    seeds = spread_seeds(200, salt=1)
    first = sample(ours, logits, params, seeds, prompts, outputs)
    second = sample(ours, logits, params, seeds, prompts, outputs)
    check.equal(second.token_ids, first.token_ids, what="tokens of a repeated call with the same seeds")
    other = sample(ours, logits, params, spread_seeds(200, salt=2), prompts, outputs)
    sampled = torch.tensor([p.temperature > 0 for p in params])
    changed = int((other.token_ids != first.token_ids)[sampled].sum())
    assert changed > 0, "changing every seed changed no sampled token: the sampler ignores the seeds"


@pytest.mark.parametrize("layout", ["all_greedy", "mixed"])
def test_greedy_is_argmax(suite, check, layout):
    ours, ref = samplers(suite)
    rows = 64
    logits = peaked_logits(rows, seed=23)
    penalized = SamplingParams(temperature=0.0, repetition_penalty=1.4, presence_penalty=0.8, frequency_penalty=0.3)
    params = [SamplingParams(temperature=0.0) if i % 4 else penalized for i in range(rows)]
    if layout == "mixed":  # greedy rows must stay the argmax when sampled rows share the batch
        params = [p if i % 2 == 0 else SamplingParams(temperature=1.0, top_k=10) for i, p in enumerate(params)]
    gen = torch.Generator().manual_seed(24)
    # every prompt holds its row's best token, so the penalised rows' argmax moves
    prompts = [torch.randint(0, 64, (12,), generator=gen).tolist() + [int(logits[i].argmax())] for i in range(rows)]
    outputs = [torch.randint(0, 64, (i % 9,), generator=gen).tolist() for i in range(rows)]
    seeds = spread_seeds(rows, salt=3)

    got = sample(ours, logits, params, seeds, prompts, outputs).token_ids
    greedy = torch.tensor([p.temperature == 0 for p in params])
    plain = torch.tensor([p.temperature == 0 and p.repetition_penalty == 1.0 for p in params])
    # no penalty: exactly the argmax of the logits; with penalties: the argmax of the penalised logits,
    # which the reference computes without any noise
    expected = torch.where(plain, logits.argmax(dim=1), sample(ref, logits, params, seeds, prompts, outputs).token_ids)
    check.equal(got[greedy], expected[greedy], what="greedy tokens")


# ---------------------------------------------------------------------------------------------
# Identical tokens to the reference
# ---------------------------------------------------------------------------------------------


def test_tokens_match_reference(suite, check):
    suite.require_declared("deterministic_sampling", why="so its draws need not equal the reference's")
    ours, ref = samplers(suite)
    rows = 300
    params, prompts, outputs = mixed_rows(rows, seed=25)
    logits = peaked_logits(rows, seed=26)
    seeds = spread_seeds(rows, salt=4)
    seeds[:4] = [0, 1, 2**63, 2**64 - 1]  # edge seeds: zero, sign bit, all ones

    expected = sample(ref, logits, params, seeds, prompts, outputs).token_ids
    got = sample(ours, logits, params, seeds, prompts, outputs).token_ids
    # counter-based noise makes a row's token independent of the rest of the batch: reversed batch, same tokens
    rev = list(range(rows - 1, -1, -1))
    got_reversed = sample(
        ours,
        logits[rev],
        [params[i] for i in rev],
        [seeds[i] for i in rev],
        [prompts[i] for i in rev],
        [outputs[i] for i in rev],
    ).token_ids
    try:
        check.equal(got, expected, what="sampled tokens vs reference")
        check.equal(got_reversed, expected[rev], what="sampled tokens of the reversed batch vs reference")
    finally:  # the agreement rate goes into the report next to the exactness record, pass or fail
        check.metric(
            max_abs_err=check.max_abs,
            max_rel_err=check.max_rel,
            tolerance=check.tolerance,
            rows=rows,
            token_agreement=float((got == expected).double().mean()),
        )


# ---------------------------------------------------------------------------------------------
# Logprobs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_logprobs", [0, 5, 20])
def test_logprobs_match_reference(suite, check, num_logprobs):
    ours, ref = samplers(suite)
    rows, vocab = 48, 256
    logits = randn(rows, vocab, seed=27, scale=3.0)
    logits[0] *= 20.0  # large logits: log-softmax must subtract the max
    logits[1] = logits[1] * 0.01 - 5.0  # nearly flat and far from zero
    params = [
        SamplingParams(
            temperature=[0.0, 1.0, 0.7][i % 3],
            top_k=[0, 30][i % 2],
            logprobs=num_logprobs,
            repetition_penalty=1.2 if i % 5 == 0 else 1.0,
        )
        for i in range(rows)
    ]
    gen = torch.Generator().manual_seed(28)
    prompts = [torch.randint(0, vocab, (8,), generator=gen).tolist() for _ in range(rows)]
    outputs = [torch.randint(0, vocab, (i % 6,), generator=gen).tolist() for i in range(rows)]
    seeds = spread_seeds(rows, salt=5)

    got = sample(ours, logits, params, seeds, prompts, outputs)
    # the reference's raw logprobs of every token: its top logprobs over the whole vocabulary
    full = sample(ref, logits, params, seeds, prompts, outputs, num_logprobs=vocab)
    table = torch.empty(rows, vocab).scatter_(1, full.top_token_ids, full.top_logprobs)
    expected_top = sample(ref, logits, params, seeds, prompts, outputs)

    for field, shape, dtype in (
        ("logprobs", (rows,), torch.float32),
        ("top_token_ids", (rows, num_logprobs), torch.int64),
        ("top_logprobs", (rows, num_logprobs), torch.float32),
    ):
        value = getattr(got, field)
        assert value.shape == shape and value.dtype == dtype, (
            f"{field}: {tuple(value.shape)}/{value.dtype}, expected {shape}/{dtype}"
        )
    # logprobs are of the raw logits (before penalties and temperature), for whichever token was chosen
    check.close(
        got.logprobs,
        table.gather(1, got.token_ids[:, None]).squeeze(1),
        torch.float32,
        reduce_dim=vocab,
        what="logprob of the chosen token",
    )
    if num_logprobs:
        check.close(
            got.top_logprobs,
            expected_top.top_logprobs,
            torch.float32,
            reduce_dim=vocab,
            what="top logprobs (values, best first)",
        )
        # ids may legitimately differ on exact ties, so each id is checked to carry its own logprob
        check.close(
            table.gather(1, got.top_token_ids),
            got.top_logprobs,
            torch.float32,
            reduce_dim=vocab,
            what="top logprobs (reference logprob of each returned id)",
        )
        assert all(row.unique().numel() == num_logprobs for row in got.top_token_ids), (
            "a row's top_token_ids repeat a token"
        )
