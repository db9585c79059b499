"""Bitwise batch invariance: a target request's tokens and top-20 logprobs must not change by a single bit
with the rest of the batch (batch size, arrival order, prefill/decode mix, prefill chunking).

Required only of backends that claim it (Capabilities.batch_invariant), which are resolved in their
batch-invariant mode (`resolve_backend(batch_invariant=True)`), on a tiny DeepSeek-V3 and, where the backend
runs DeepSeek-V4 and does not list "v4_batch_invariance" as unsupported, a tiny DeepSeek-V4 (windows, rings,
compressor states, the indexer's top-k, hyper-connections). A negative control always runs: the same
comparison over a deliberately batch-variant op table must report the variance.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch

from deepinfer_core.backend.ops import V4_OPS
from deepinfer_core.engine.llm import LLM
from deepinfer_core.kv.layout import CacheKind
from deepinfer_core.sampling.params import SamplingParams

VOCAB = 512  # the tiny checkpoints' (tiny_v3.TINY_V3, tiny_v4.TINY_V4)
TARGET_LENGTH = 60  # prefilled whole, as 32 + 28, or in 8-token chunks by the budgets below
NEW_TOKENS = 10
WHOLE, MEDIUM, SMALL = 4096, 32, 8  # max_num_batched_tokens
MODES = {
    "greedy": SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=20),
    "seeded": SamplingParams(temperature=0.9, seed=1234, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=20),
}


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


TARGET_PROMPT = _tokens(TARGET_LENGTH, 0)
# the rest of the batch: different lengths, finishing at different steps, greedy and sampled rows
OTHERS = (
    (_tokens(7, 1), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
    (_tokens(19, 2), SamplingParams(temperature=0.8, seed=5, top_k=50, max_tokens=4, ignore_eos=True)),
    (_tokens(33, 3), SamplingParams(temperature=1.0, top_p=0.9, max_tokens=14, ignore_eos=True, logprobs=3)),
    (_tokens(48, 4), SamplingParams(temperature=0, repetition_penalty=1.2, min_p=0.05, max_tokens=7, ignore_eos=True)),
)


@dataclass(frozen=True)
class Variant:
    """One way to run the target: `others` (indices into OTHERS) arrive at the given engine steps and the
    target at `target_step`; arrivals of one step are added in list order, the target at `target_at`."""

    name: str
    budget: int = WHOLE  # max_num_batched_tokens
    others: tuple[tuple[int, int], ...] = ()  # (index into OTHERS, arrival step)
    target_at: int = 0
    target_step: int = 0


ALL_OTHERS = tuple((i, 0) for i in range(len(OTHERS)))
BASELINE = Variant("alone")
# family -> (target's sampling mode, variants); every variant is compared with the target run alone
FAMILIES = {
    "batch_size": ("greedy", [Variant(f"batch of {n}", others=ALL_OTHERS[: n - 1]) for n in range(2, 6)]),
    "arrival_order": ("greedy", [Variant(f"target {k + 1} of 5", others=ALL_OTHERS, target_at=k) for k in (1, 2, 4)]),
    "prefill_decode_mix": (
        "greedy",
        [
            Variant("target decodes while others prefill", budget=64, others=((3, 2), (2, 3), (0, 5))),
            Variant("target prefills while others decode", others=((0, 0), (2, 0), (3, 0)), target_at=3, target_step=3),
            Variant(
                "mixed, 32-token chunks", budget=MEDIUM, others=((3, 0), (0, 1), (2, 4)), target_at=1, target_step=1
            ),
        ],
    ),
    "chunk_size": (
        "greedy",
        [
            Variant("alone, 8-token chunks", budget=SMALL),
            Variant("alone, 32-token chunks", budget=MEDIUM),
            Variant("batch of 4, 8-token chunks", budget=SMALL, others=((0, 0), (1, 0), (3, 0)), target_at=2),
        ],
    ),
    "seeded_sampling": (
        "seeded",
        [
            Variant("seeded, batch of 5", others=ALL_OTHERS),
            Variant("seeded, target 4 of 5", others=ALL_OTHERS, target_at=3),
            Variant("seeded, target decodes while others prefill", budget=64, others=((3, 2), (2, 3))),
            Variant("seeded, 8-token chunks with others", budget=SMALL, others=((1, 0), (2, 1)), target_at=1),
        ],
    ),
}


@dataclass
class Run:
    name: str
    tokens: tuple[int, ...]
    top: list[list[tuple[int, float]]] = field(repr=False)  # per new token: top-20 (token, logprob)


_request_ids = itertools.count()


def run_variant(backend, path, target: SamplingParams, variant: Variant) -> Run:
    """The target's output under `variant`, on a fresh engine (prefix caching off)."""
    llm = LLM(  # V4's window snapshots (host copies at block boundaries) change nothing here; kept off
        window_snapshot_gb=0,
        model=path,
        backend=backend,
        num_kv_blocks=-(-2048 // backend.kv_layout.block_size) + 8,
        max_num_batched_tokens=variant.budget,
        enable_prefix_caching=False,
        progress=False,
    )
    arrivals = [(step, OTHERS[i][0], OTHERS[i][1]) for i, step in variant.others]
    arrivals.insert(variant.target_at, (variant.target_step, TARGET_PROMPT, target))
    pending = sorted((step, k, prompt, params) for k, (step, prompt, params) in enumerate(arrivals))
    engine, step, finished, target_id = llm.engine, 0, {}, None
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, k, prompt, params = pending.pop(0)
            request_id = f"bi-{next(_request_ids)}"
            engine.add_request(request_id, prompt, params)
            if k == variant.target_at:
                target_id = request_id
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
        step += 1
    out = finished[target_id].outputs[0]
    return Run(variant.name, out.token_ids, [list(t.items()) for t in out.top_logprobs])


def differences(baseline: Run, runs: Sequence[Run]) -> tuple[list[str], float]:
    """Compare each run with the baseline bit for bit: (one line per run that differs, max |logprob diff|
    over the tokens both top-20 lists hold)."""
    found, worst = [], 0.0
    for run in runs:
        problems = []
        if run.tokens != baseline.tokens:
            i = next(i for i, (a, b) in enumerate(zip(run.tokens, baseline.tokens)) if a != b)
            problems.append(f"new token {i} is {run.tokens[i]}, alone {baseline.tokens[i]}")
        # python floats hold the float32 logprobs exactly, so == on the (token, logprob) lists is bitwise
        bad = [i for i, (ours, base) in enumerate(zip(run.top, baseline.top)) if ours != base]
        if bad:
            diff = max(
                (
                    abs(dict(ours)[t] - v)
                    for ours, base in zip(run.top, baseline.top)
                    for t, v in base
                    if t in dict(ours)
                ),
                default=float("nan"),
            )
            worst = max(worst, diff)
            problems.append(
                f"top-20 logprobs differ at {len(bad)}/{len(run.top)} new tokens, first at {bad[0]} "
                f"(max abs {diff:.3g})"
            )
        if problems:
            found.append(f"{run.name}: " + ", ".join(problems))
    return found, worst


def compare(backend, path, family: str) -> tuple[list[str], float, int]:
    """Run the target alone and under every variant of `family`: (violations, max abs diff, runs)."""
    mode, variants = FAMILIES[family]
    baseline = run_variant(backend, path, MODES[mode], BASELINE)
    assert len(baseline.tokens) >= 8 and all(len(t) == 20 for t in baseline.top)
    found, worst = differences(baseline, [run_variant(backend, path, MODES[mode], v) for v in variants])
    return found, worst, len(variants)


def message(found: list[str], total: int) -> str:
    return f"batch invariance violated in {len(found)}/{total} runs: " + "; ".join(found)


def _v4_block_size(suite) -> int:
    """Skip unless the backend runs DeepSeek-V4 batch-invariantly; a block size the tiny V4's rates divide."""
    for op in (*V4_OPS, "v4_batch_invariance"):
        suite.require(op)
    for kind in CacheKind:
        suite.require_declared("cache_kinds", kind, why="V4 caches need it")
    sizes = [size for size in suite.capabilities.block_sizes if size % 16 == 0]  # the HCA rate divides them
    if not sizes:
        pytest.skip(f"no block size of {suite.under_test.name} ({suite.capabilities.block_sizes}) is a multiple of 16")
    return min(sizes)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("model", ["v3", "v4"])
def test_batch_invariance(suite, check, tiny_v3, tiny_v4, model, dtype, family):
    suite.require_declared("batch_invariant")
    suite.require_dtype(dtype)
    block_size = _v4_block_size(suite) if model == "v4" else None
    backend = suite.resolved(suite.under_test, dtype, block_size, batch_invariant=True)  # the mode it claims
    found, worst, total = compare(backend, tiny_v3(32) if model == "v3" else tiny_v4, family)
    check.metric(
        max_abs_err=worst,
        tolerance={"exact": True},
        runs=total,
        violations=len(found),
        violated=[line.split(":")[0] for line in found],
    )
    assert not found, message(found, total)


class RowCountDependentOps:
    """A deliberately batch-variant op table: `linear` drifts with the number of rows in the step;
    every other op is the wrapped table's own."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = self._inner.linear(x, weight, bias)
        return out + 1e-3 * (x.shape[0] % 5) * out.abs().mean()


def test_negative_control_detects_batch_variance(suite, check, tiny_v3):
    """Always runs: the comparison above must catch an op table whose linear depends on the batch."""
    dtype = torch.float32 if "float32" in suite.capabilities.dtypes else getattr(torch, suite.capabilities.dtypes[0])
    backend = suite.resolved(suite.under_test, dtype)
    variant = dataclasses.replace(backend, ops=RowCountDependentOps(backend.ops))
    found, worst, total, undetected = [], 0.0, 0, []
    for family in FAMILIES:
        violations, diff, runs = compare(variant, tiny_v3(32), family)
        found, worst, total = found + violations, max(worst, diff), total + runs
        if not violations:
            undetected.append(family)
    check.metric(
        max_abs_err=worst,
        runs=total,
        violations=len(found),
        undetected_families=undetected,
        detected=message(found, total)[:2000],
    )
    assert found, (
        f"the batch-invariance comparison saw no difference in {total} runs of a batch-variant op "
        f"table (linear drifts with x.shape[0]): it cannot detect violations"
    )
    assert not undetected, f"the comparison missed the planted batch variance in: {', '.join(undetected)}"
