"""Start-up profiling for adaptive verification: what a verify step of t tokens takes on this device.

Adaptive verification (engine/speculative.py `plan_verification`) admits draft slots while the tokens a step is
expected to yield per second of its cost grow, so it needs a step's cost by its token count on this backend, not
a generic formula. At engine build, `profile_verify_steps` runs dummy steps through the model runner (the real
model, sampler, drafter and caches) at a handful of token counts, times them with the backend's `StepTimer`, and
returns two `StepCostTable`s: steps of verifies (k + 1 tokens a sequence, up to the most a step holds) and plain
decode steps (one token a sequence), which a backend may run quite differently (replayed from a device graph);
a step whose drafts are all cut is one of those.
"""

from __future__ import annotations

import logging

from deepinfer_core.backend import StepCostTable, StepTimer
from deepinfer_core.engine.block_manager import BlockManager
from deepinfer_core.engine.request import Request, RequestStatus
from deepinfer_core.engine.runner import ModelRunner
from deepinfer_core.engine.scheduler import SchedulerConfig
from deepinfer_core.engine.speculative import AcceptanceEstimate, SpeculativeConfig
from deepinfer_core.sampling.params import SamplingParams

__all__ = [
    "MAX_PROFILED_TOKENS",
    "TIMED_RUNS",
    "dummy_verify_step",
    "profile_padded_steps",
    "profile_verify_steps",
    "profiled_token_counts",
    "scheduler_options",
]

log = logging.getLogger(__name__)

MAX_PROFILED_TOKENS = 512  # past this the table is extrapolated: a step this large is rarely all verifies
TIMED_RUNS = 2  # per token count, after one warm-up run: start-up stays short


def profiled_token_counts(config: SchedulerConfig, num_speculative_tokens: int) -> list[int]:
    """Token counts to time: powers of two, then the most a step holds (every sequence's token and all its
    `num_speculative_tokens` drafts, within the step's token budget and MAX_PROFILED_TOKENS), each rounded up to
    whole sequences of 1 + num_speculative_tokens (a step replayed from a graph is padded to them anyway)."""
    top = min(config.max_num_seqs * (num_speculative_tokens + 1), config.max_num_batched_tokens, MAX_PROFILED_TOKENS)
    counts = [1 << i for i in range(top.bit_length()) if 1 << i < top] + [top]
    per_sequence = num_speculative_tokens + 1
    return sorted({-(-t // per_sequence) * per_sequence for t in counts})


def dummy_verify_step(tokens: int, max_num_seqs: int, block_size: int, per_sequence: int) -> list[tuple[Request, int]]:
    """A dummy step of `tokens` tokens: as many sequences at the start of their context as hold them with at
    most `per_sequence` tokens each (within max_num_seqs), each verifying its one token and drafts (token id 0
    throughout), the tokens spread evenly; per_sequence 1: a decode step.

    Every sequence's positions are in blocks 0, 1, ... (shared: they write the same entries, whose values are
    never used) and sequence i is in per-sequence slot i."""
    num_seqs = min(-(-tokens // per_sequence), max_num_seqs)
    step = []
    for i in range(num_seqs):
        count = tokens // num_seqs + (i < tokens % num_seqs)
        request = Request(f"profile-{i}", None, [0], SamplingParams(), seed=i, arrival=-1)
        request.status = RequestStatus.RUNNING
        request.block_ids = list(range(-(-count // block_size)))
        request.seq_slot = i
        request.draft_token_ids = [0] * (count - 1)
        step.append((request, count))
    return step


def profile_verify_steps(
    runner: ModelRunner, timer: StepTimer, blocks: BlockManager, config: SchedulerConfig, num_speculative_tokens: int
) -> tuple[StepCostTable, StepCostTable]:
    """Time dummy steps with `timer` on the runner's model and caches -> (decode steps' costs at one token a
    sequence up to max_num_seqs, verify steps' at `profiled_token_counts`, k + 1 tokens a sequence).

    Called before the engine takes its first request. The steps write the paged caches' entries of positions
    0..k of blocks 0, 1, ... and per-sequence slots 0..max_num_seqs-1, and read only what they wrote. Nothing
    a real request reads is left behind: those blocks are free and hold no prefix-cache hash (the block manager
    never saw these steps), so no prefix hit finds them, and a request that is later given one reads only the
    entries it has written itself (a paged cache's entries past a sequence's length are never read: rejected
    drafts rely on the same); a sequence slot's ring and state entries before a request's `window_start` are
    stale by definition, as they are when a finished request hands its slot on."""
    if blocks.num_used_blocks:
        raise RuntimeError("verify steps are profiled before any request holds a KV block, not after")
    needed = -(-(num_speculative_tokens + 1) // blocks.block_size)
    if blocks.num_blocks < needed:
        raise RuntimeError(
            f"a verify step of {num_speculative_tokens} drafts needs {needed} KV blocks; the cache has "
            f"{blocks.num_blocks}: give the engine more KV memory or draft fewer tokens"
        )
    tables = []
    for per_sequence, kind in ((1, "decode"), (num_speculative_tokens + 1, "verify")):
        tables.append(_profile(runner, timer, config, blocks.block_size, per_sequence, kind))
    return tables[0], tables[1]


def profile_padded_steps(
    runner: ModelRunner, timer: StepTimer, config: SchedulerConfig, block_size: int, num_speculative_tokens: int
) -> tuple[StepCostTable, ...]:
    """For a runner that replays verify steps from device graphs, each sequence padded to the step's most drafts
    d: per d = 1..k, the costs of steps of B sequences of 1 + d tokens (B up to the graphs' batch), by their
    tokens; what a padded step costs depends on both (profile_verify_steps' tables are at d = k). Index d - 1."""
    most = min(config.max_num_seqs, runner.graphs.max_batch)
    sizes = profiled_token_counts(SchedulerConfig(max_num_seqs=most, max_num_batched_tokens=most), 0)
    return tuple(
        _profile(runner, timer, config, block_size, 1 + d, f"padded verify (d = {d})", [b * (1 + d) for b in sizes])
        for d in range(1, num_speculative_tokens + 1)
    )


def _profile(runner, timer, config, block_size: int, per_sequence: int, kind: str, counts=None) -> StepCostTable:
    """The table of dummy steps of per_sequence tokens a sequence, at `counts` tokens (profiled_token_counts')."""
    counts = counts or profiled_token_counts(config, per_sequence - 1)
    seconds = []
    for tokens in counts:
        step = dummy_verify_step(tokens, config.max_num_seqs, block_size, per_sequence)
        seconds.append(timer.time(lambda step=step: runner.execute(step).tokens.token_ids, runs=TIMED_RUNS))
    table = StepCostTable(tuple(counts), tuple(seconds))
    log.info("%s step costs (profiled at start-up for adaptive verification): %r", kind, table)
    return table


def scheduler_options(
    spec: SpeculativeConfig, runner: ModelRunner, timer: StepTimer, blocks: BlockManager, config: SchedulerConfig
) -> dict:
    """The Scheduler's keyword arguments for speculative decoding with `spec`: its proposer and draft counts,
    and for adaptive verification the acceptance estimate and the step costs profiled here, now."""
    options = {
        "proposer": spec.proposer(),
        "num_speculative_tokens": spec.num_speculative_tokens,
        "lookahead": spec.lookahead,
    }
    if spec.verify == "adaptive":  # it plans with steps' measured costs
        decode, verify = profile_verify_steps(runner, timer, blocks, config, spec.num_speculative_tokens)
        options |= {
            "acceptance": AcceptanceEstimate(spec.num_speculative_tokens),
            "step_costs": verify,
            "decode_costs": decode,
        }
        if runner.graphs is not None:  # verify steps of up to its batch are padded: their costs go by depth
            options |= {
                "padded_verify_batch": runner.graphs.max_batch,
                "padded_costs": profile_padded_steps(
                    runner, timer, config, blocks.block_size, spec.num_speculative_tokens
                ),
            }
    return options
