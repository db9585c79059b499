"""Continuous batching: which requests run this step and how many tokens each, under a token budget.

Running requests go first, in arrival order (a decode is 1 token; a prefill chunk is as many tokens as
the budget and the backend's cost model allow). When KV blocks run out, the latest-arrived running
request is preempted: its blocks are freed and it goes back to the front of the queue, to be
recomputed later (largely from the prefix cache). Where window snapshots are kept, a prompt's computation
stops once at its last block boundary, so that a later request sharing the prompt finds its windows
there (engine/snapshots.py). Waiting requests are admitted only while nothing
had to be preempted this step. With asynchronous scheduling a request's newest token may still be in
flight (`Request.num_pending_tokens`): it is planned for like any other token. With speculative decoding a
decode also verifies the tokens the proposer drafts for it (`Request.draft_token_ids`), as many as the token
budget and the request's remaining length allow.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from deepinfer_core.backend import StepCostTable
from deepinfer_core.engine.block_manager import BlockManager
from deepinfer_core.engine.cost import CostModel, largest_chunk
from deepinfer_core.engine.limits import at_least_one
from deepinfer_core.engine.request import Request, RequestStatus
from deepinfer_core.engine.snapshots import snapshot_boundary
from deepinfer_core.engine.speculative import AcceptanceEstimate, DrafterProposer, NgramProposer, plan_verification

__all__ = ["ScheduledStep", "Scheduler", "SchedulerConfig"]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # requests in one step
    max_num_batched_tokens: int = 2048  # tokens in one step
    step_budget_s: float = 0.5  # target step time; prefill chunks are sized to it by the cost model

    def __post_init__(self) -> None:
        # any budget of 1 or more makes progress: prefills are chunked down to 1 token, decodes take 1
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            at_least_one(name, getattr(self, name))


@dataclass(frozen=True, slots=True)
class ScheduledStep:
    requests: list[tuple[Request, int]]  # (request, tokens computed for it this step)
    num_preempted: int
    num_proposed_tokens: int = 0  # drafts proposed for the step, before adaptive verification cut them

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.requests)


OVERHEAD_WEIGHT = 0.1  # of each planned step's time gap in the running step_overhead


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        blocks: BlockManager,
        cost_model: CostModel,
        proposer: NgramProposer | DrafterProposer | None = None,
        num_speculative_tokens: int = 0,
        lookahead: int = 0,
        acceptance: AcceptanceEstimate | None = None,
        step_costs: StepCostTable | None = None,
        decode_costs: StepCostTable | None = None,
        padded_verify_batch: int = 0,
        padded_costs: Sequence[StepCostTable] = (),
    ) -> None:
        """lookahead: KV slots a decode needs past its own and its drafts' (a draft model drafting further).
        acceptance: adaptive verification; each step's drafts are cut to `plan_verification`'s choice.
        step_costs: what a step with drafts takes by its tokens, measured (engine/step_costs.py); adaptive
        verification weighs drafts by it, or by `cost_model` without one. decode_costs: the same of steps without
        drafts (a step whose drafts are all cut), if measured apart. padded_verify_batch: steps of decodes only, up
        to this many, pad every sequence to the step's most drafts (the runner replays them from device graphs);
        adaptive verification then picks each such step's draft depth, by `padded_costs` where measured (index
        d - 1: steps of 1 + d tokens a sequence, step_costs.profile_padded_steps)."""
        self.config, self.blocks, self.cost_model, self.step_costs = config, blocks, cost_model, step_costs
        self.proposer, self.num_speculative_tokens, self.lookahead = proposer, num_speculative_tokens, lookahead
        self.acceptance, self.decode_costs, self.padded_verify_batch = acceptance, decode_costs, padded_verify_batch
        self.padded_costs = tuple(padded_costs)
        # seconds a planned step takes beyond its table cost (the engine's own work around the runner: planning,
        # reading tokens back, stop checks), learned from the steps run (record_step_time); added to every cost
        self.step_overhead = 0.0
        self._predicted: float | None = None  # the table cost of the step last planned, until its time comes
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def add_first(self, requests: Sequence[Request]) -> None:
        """Queue requests ahead of every waiting one: the further samples of a request that already runs."""
        self.waiting.extendleft(reversed(requests))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk(self, request: Request, computed: int, budget: int) -> int:
        remaining = request.num_tokens - computed
        if self.blocks.snapshots is not None:  # end a step at the last block boundary: its windows are kept
            boundary = snapshot_boundary(request.num_tokens, self.blocks.block_size)
            if computed < boundary:
                remaining = boundary - computed
        if remaining <= 1:
            return min(remaining, budget)
        fits = largest_chunk(self.cost_model, computed, remaining, self.config.step_budget_s)
        return min(remaining, budget, fits)

    def _drafts(self, request: Request, budget: int, unsettled: int | None) -> list[int]:
        """Tokens to verify after a decode's one (none for a prefill chunk or without a proposer). unsettled: not
        None when the request's newest token and drafts are in flight (see `schedule`): placeholders then."""
        in_flight = unsettled is not None
        decode = request.num_computed_tokens == request.num_tokens - 1 and (in_flight or not request.num_pending_tokens)
        if self.proposer is None or not decode or request.needs_prompt_logprobs:
            return []
        room = request.max_num_tokens - request.num_tokens - (unsettled or 0) - 1  # the step's own token needs one
        count = min(self.num_speculative_tokens, room, budget - 1)
        if in_flight:  # drafted by the step in flight: the runner takes them from the device
            return [0] * max(count, 0)
        return self.proposer.propose_for(request, count)

    def _preempt(self, request: Request) -> None:
        request.draft_token_ids, request.next_draft_token_ids, request.next_draft_confidence = [], [], []
        self.blocks.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def record_step_time(self, seconds: float) -> None:
        """The wall time of the step last scheduled, from its planning to its tokens' report: where adaptive
        verification planned it, the gap to its table cost moves `step_overhead` (a running mean)."""
        if self._predicted is not None:
            gap = seconds - self._predicted
            self.step_overhead = max(0.0, self.step_overhead + OVERHEAD_WEIGHT * (gap - self.step_overhead))
        self._predicted = None

    def schedule(self, unsettled: Mapping[Request, int] | None = None) -> ScheduledStep:
        """The next step. unsettled (a pipelined step of speculative decoding, engine.py): the requests whose newest
        token and drafts the step in flight makes, with the drafts it verifies for each; whether it accepts them is
        known only on the device, so each may run up to that many positions further than the host counts: its
        drafts, blocks and room are planned for the most."""
        self._predicted = None
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted = 0
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            further = unsettled.get(request) if unsettled else None
            if request.num_tokens + (further or 0) >= request.max_num_tokens:  # its last token may be in flight
                index += 1
                continue
            count = self._chunk(request, request.num_computed_tokens, budget)
            request.draft_token_ids = self._drafts(request, budget, further)
            count += len(request.draft_token_ids)
            samples = request.num_computed_tokens + count - len(request.draft_token_ids) >= request.num_tokens
            ahead = self.lookahead if samples else 0  # a draft model drafts on past the step's positions
            while not self.blocks.grow(request, request.num_computed_tokens + (further or 0) + count + ahead):
                victim = self.running.pop()  # the latest arrival
                self._preempt(victim)
                preempted += 1
                if victim is request:
                    break
            else:
                scheduled.append((request, count))
                budget -= count
                index += 1
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            cached = self.blocks.cached_prefix_tokens(request)
            count = self._chunk(request, cached, budget)
            ahead = self.lookahead if cached + count >= request.num_tokens else 0  # as for running requests
            if not self.blocks.admit(request, count + ahead):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self.running.sort(key=lambda r: r.arrival)
            scheduled.append((request, count))
            budget -= count
        proposed = sum(len(request.draft_token_ids) for request, _ in scheduled)
        if self.acceptance is not None:
            scheduled = self._plan_drafts(scheduled)
        return ScheduledStep(scheduled, preempted, proposed)

    def _plan_drafts(self, scheduled: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        """Adaptive verification: cut each decode's drafts to what `plan_verification` admits for this step."""
        decodes = [i for i, (request, _) in enumerate(scheduled) if request.draft_token_ids]
        if not decodes:
            return scheduled
        offered = [len(scheduled[i][0].draft_token_ids) for i in decodes]
        base = sum(count for _, count in scheduled) - sum(offered)
        context = max(scheduled[i][0].num_tokens for i in decodes)

        padded = base == len(scheduled) <= self.padded_verify_batch  # one token each besides drafts: all decodes

        def step_cost(tokens: int) -> float:
            if tokens == base and self.decode_costs is not None:  # no draft verified: a plain decode step
                return self.decode_costs.cost(tokens)
            if padded and self.padded_costs:  # base (1 + d) tokens: depth d
                return self.padded_costs[tokens // base - 2].cost(tokens)
            if self.step_costs is not None:
                return self.step_costs.cost(tokens)
            return self.cost_model.cost(tokens, context)

        estimate = self.acceptance.survival()  # from the acceptance counts so far, where no draft model says
        survival = [draft_survival(scheduled[i][0]) or estimate for i in decodes]
        overhead = self.step_overhead
        take = plan_verification(offered, survival, lambda tokens: step_cost(tokens) + overhead, base, padded)
        self._predicted = step_cost(base * (1 + max(take)) if padded else base + sum(take))
        planned = list(scheduled)
        for i, keep in zip(decodes, take):
            request, count = scheduled[i]
            planned[i] = (request, count - (len(request.draft_token_ids) - keep))
            request.draft_token_ids = request.draft_token_ids[:keep]
        return planned

    def finish(self, request: Request) -> None:
        """Remove a finished or aborted request and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.blocks.free(request)
        request.status = RequestStatus.FINISHED


def draft_survival(request: Request) -> list[float]:
    """The probability that each of the request's drafts is accepted with all before it, from its draft
    model's confidences (the conditional probabilities; DSpark's confidence head); [] without them."""
    survival, alive = [], 1.0
    for confidence in request.next_draft_confidence[: len(request.draft_token_ids)]:
        alive *= confidence
        survival.append(alive)
    return survival
