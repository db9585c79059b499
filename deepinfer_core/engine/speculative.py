"""Speculative decoding: what to draft, and which drafted tokens a verify step accepts.

A verify step feeds a sequence's last token and its k drafted tokens at once and samples a token at each of
the k + 1 positions, every one with the noise of its own (seed, output index), exactly as a decode step at
that position would. Coupled acceptance keeps drafted token i while it equals the token sampled at its
position; the first that differs is replaced by the sampled one (and the rest are dropped), and when all k
hold, the token sampled after the last comes free. So the output is the non-speculative output token for
token, for greedy and seeded sampling alike, whatever the draft: the draft only decides how many tokens a
step yields.

Drafts come from a proposer. `ngram` (vLLM's prompt lookup) needs no model: it finds the longest recent
n-gram of the sequence that occurred earlier and proposes the tokens that followed it. `mtp` drafts with the
checkpoint's multi-token-prediction layer (model/mtp.py), on the device, in the step before.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields

import torch

from deepinfer_core.errors import DeepInferError
from deepinfer_core.kv.layout import CacheKind

__all__ = [
    "AcceptanceEstimate",
    "DrafterProposer",
    "NgramProposer",
    "SpeculativeConfig",
    "SpeculativeError",
    "SpeculativeStats",
    "accepted_prefix",
    "check_model",
    "plan_verification",
]

METHODS = ("ngram", "mtp", "dspark")
VERIFY_MODES = ("fixed", "adaptive")
ACCEPTANCE_MODES = ("coupled", "rejection")


class SpeculativeError(DeepInferError):
    """A speculative config that cannot run as asked."""


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's --speculative-config fields (method, num_speculative_tokens, prompt_lookup_max / _min) and ours:
    verify ("fixed": every step verifies num_speculative_tokens drafts, as far as the request may grow;
    "adaptive": `plan_verification` chooses how many of them each request verifies, from the drafts' survival
    estimates and the backend's step cost) and acceptance ("coupled": a draft token stays iff it equals the
    token sampled at its position; "rejection": standard rejection sampling, sampling/rejection.py: the same
    distribution, not the same tokens as plain decoding)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    verify: str = "fixed"
    acceptance: str = "coupled"

    def __post_init__(self) -> None:
        choices = {"method": METHODS, "verify": VERIFY_MODES, "acceptance": ACCEPTANCE_MODES}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise SpeculativeError(
                    f"speculative config: {name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}"
                )
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpeculativeError(f"speculative config: {name} must be an integer of 1 or more, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise SpeculativeError(
                f"speculative config: prompt_lookup_min ({self.prompt_lookup_min}) is above prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )

    @classmethod
    def parse(cls, value: str | Mapping | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From a JSON object (--speculative-config), a mapping (LLM(speculative_config=...)) or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise SpeculativeError(
                    f"--speculative-config is not valid JSON ({err.msg} at character {err.pos}); "
                    'for example: \'{"method": "ngram", "num_speculative_tokens": 4}\''
                ) from None
        if not isinstance(value, Mapping):
            raise SpeculativeError(f"the speculative config must be a JSON object, got {type(value).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise SpeculativeError(
                f"speculative config: unknown field(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)}"
            )
        missing = [name for name in ("method", "num_speculative_tokens") if name not in value]
        if missing:
            raise SpeculativeError(f"speculative config: {' and '.join(missing)} must be given")
        return cls(**value)

    def proposer(self) -> NgramProposer | DrafterProposer:
        if self.method == "ngram":
            return NgramProposer(self.prompt_lookup_min, self.prompt_lookup_max)
        return DrafterProposer()

    @property
    def lookahead(self) -> int:
        """KV slots past a verify step's own that a step may write: a draft model's further draft positions (k - 1
        of them), and the filler tokens that pad every sequence of a verify step replayed from a device graph to
        the step's most (k past its first at most)."""
        return self.num_speculative_tokens


class NgramProposer:
    """Prompt lookup: for n from `max_n` down to `min_n`, the last n tokens of the sequence; at their latest
    earlier occurrence, the tokens that followed it are the draft (at most k, fewer where the sequence ends)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose_for(self, request, k: int) -> list[int]:
        return self.propose(request.all_token_ids, k)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        if k <= 0 or len(tokens) < self.min_n + 1:
            return []
        seq = torch.tensor(tokens, dtype=torch.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            windows = seq[:-1].unfold(0, n, 1)  # every n-gram that ends before the last token: [L - n, n]
            hits = (windows == seq[-n:]).all(dim=1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n  # the token after the latest earlier occurrence
                return seq[start : start + k].tolist()
        return []


class DrafterProposer:
    """A draft model's drafts (MTP): made on the device by the step before, read back with its tokens."""

    def propose_for(self, request, k: int) -> list[int]:
        return request.next_draft_token_ids[: max(k, 0)]


def accepted_prefix(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """How many leading drafts equal the tokens sampled at their positions (targets[i] for drafts[i])."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return n


@dataclass(slots=True)
class SpeculativeStats:
    """Counters since the engine started (vLLM's spec_decode metrics): verify steps' drafts, drafted tokens
    verified, accepted ones, and accepted ones by draft position; and drafted tokens proposed (before adaptive
    verification cut them: as many as verified with fixed verification)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_proposed_tokens: int = 0
    accepted_per_position: list[int] | None = None

    def record(self, drafted: int, accepted: int, positions: int) -> None:
        if self.accepted_per_position is None:
            self.accepted_per_position = [0] * positions
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify step yields on average: its accepted drafts plus the one it samples itself."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class AcceptanceEstimate:
    """Per draft position, how often a draft offered there was accepted given those before it were: the
    survival curve the adaptive planner weighs drafts by, for drafters without a confidence head (ngram, MTP).
    Each rate starts from a Beta(prior_accepted, prior_rejected) prior, so an unseen position is not ruled out."""

    def __init__(self, positions: int, prior_accepted: float = 1.0, prior_rejected: float = 1.0) -> None:
        self.offered = [0] * positions
        self.accepted = [0] * positions
        self.prior = (prior_accepted, prior_rejected)

    def record(self, offered: int, accepted: int) -> None:
        """One verify step of a request: `offered` drafts, the first `accepted` of them kept."""
        for i in range(min(offered, accepted + 1)):  # a position counts once the drafts before it held
            self.offered[i] += 1
            self.accepted[i] += i < accepted

    def survival(self) -> list[float]:
        """P(drafts 1..j are all accepted), j = 1..positions."""
        a, r = self.prior
        out, alive = [], 1.0
        for offered, accepted in zip(self.offered, self.accepted):
            alive *= (accepted + a) / (offered + a + r)
            out.append(alive)
        return out


def plan_verification(
    offered: Sequence[int],
    survival: Sequence[Sequence[float]],
    step_cost: Callable[[int], float],
    base_tokens: int,
    padded: bool = False,
) -> list[int]:
    """How many of its offered drafts each request verifies this step (adaptive verification).

    offered[i]: drafts request i has; survival[i][j]: the probability its drafts 1..j+1 are all accepted;
    step_cost(t): the step's estimated time with t tokens in it; base_tokens: the step's tokens without any
    draft (each decode's own token, prefill chunks). Draft slots are taken across the batch best first (highest
    survival: each request's are in order); of every such prefix (none included) the one whose expected tokens
    per second of step cost is highest is admitted: a step cost may jump (a step with drafts can run otherwise
    than one without), so a slot that lowers the rate does not end the search. The step yields at least one
    token per decode whatever is admitted.

    padded: the step is all decodes, each padded to the most drafts admitted (a verify step replayed from a
    device graph), so it costs step_cost(base_tokens * (1 + d)) for depth d whatever each request verifies up
    to d: every request then verifies min(d, offered) drafts, d the depth of the highest rate."""
    if padded:
        rates = [
            (base_tokens + sum(sum(s[:d]) for s in survival)) / step_cost(base_tokens * (1 + d))
            for d in range(max(offered, default=0) + 1)
        ]
        depth = max(range(len(rates)), key=lambda d: (rates[d], -d))
        return [min(depth, n) for n in offered]
    slots = sorted(
        ((survival[i][j], i, j) for i, n in enumerate(offered) for j in range(n)), key=lambda s: (-s[0], s[1], s[2])
    )
    take = [0] * len(offered)
    tokens, expected = base_tokens, float(len(offered))
    best, best_take = expected / step_cost(tokens), list(take)
    for gain, i, j in slots:
        if j != take[i]:  # a request's drafts are verified in order
            continue
        take[i], tokens, expected = j + 1, tokens + 1, expected + gain
        if (rate := expected / step_cost(tokens)) > best:
            best, best_take = rate, list(take)
    return best_take


def check_model(model, spec: SpeculativeConfig, drafter=None) -> None:
    """The method has its draft model (`drafter`: None for ngram), and rejected drafts leave no trace a later
    step reads: in paged caches their entries lie past the sequence's length and are rewritten first; a model
    with per-sequence caches (rings, states) says how many drafts a step may verify without that
    (`speculative_max_drafts`: spare ring slots and state rows)."""
    if (spec.method == "ngram") != (drafter is None):
        raise SpeculativeError(
            f"speculative method {spec.method!r} "
            + ("needs the checkpoint's draft layers, which were not loaded" if drafter is None else
               "takes no draft model")
        )  # fmt: skip
    limit = getattr(model, "speculative_max_drafts", None)
    if limit is not None:
        if spec.num_speculative_tokens > limit:
            raise SpeculativeError(
                f"{type(model).__name__} can roll back at most {limit} drafted tokens a step "
                f"(its window rings' spare slots); num_speculative_tokens is {spec.num_speculative_tokens}"
            )
        return
    kinds = {cache.kind for layer in model.cache_specs for cache in layer.values()}
    others = sorted(kind.value for kind in kinds - {CacheKind.PAGED})
    if others:
        raise SpeculativeError(
            f"speculative decoding of {type(model).__name__} is not supported yet: its {', '.join(others)} "
            "caches would need rejected drafts rolled back (paged caches only so far); run it without "
            "--speculative-config"
        )
