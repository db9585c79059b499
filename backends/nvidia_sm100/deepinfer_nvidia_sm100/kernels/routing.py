"""MoE routing in one kernel (one program per token) in place of a dozen tensor ops: scores (softmax,
sigmoid, or V4's sqrtsoftplus), the correction bias for choosing, the group filter (V2's best expert,
V3's two best), the top-k experts by repeated argmax, and the weights (raw scores, normalized, scaled).
V4's hash routing (the experts given per token) reuses it: the same scores, gathered at the given ids.
Row-local, so batch-invariant; exact ties go to the lower expert id, as the contract asks."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.backend.ops import RoutingConfig
from deepinfer_nvidia_sm100.kernels._common import next_pow2

NEG_INF = tl.constexpr(float("-inf"))  # a global a kernel reads must be a constexpr
SCORINGS = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}  # the kernel's SCORING constexpr
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # torch's softplus: x itself above it (exp(x) would overflow later)


@triton.jit
def _log1p_exp(x):
    """softplus(x) = log(1 + exp(x)) as torch computes it: x above 20, else log1p(exp(x)), the log1p
    accurate for tiny exp(x) too (u = 1 + e; log(u) * e / (u - 1) cancels the rounding of u). The branch
    not taken stays finite: exp of at most 20, no 0 / 0."""
    e = tl.exp(tl.minimum(x, SOFTPLUS_THRESHOLD, propagate_nan=tl.PropagateNan.ALL))
    u = 1.0 + e
    tiny = u == 1.0
    small = tl.where(tiny, e, tl.log(u) * (e / tl.where(tiny, 1.0, u - 1.0)))
    return tl.where(x > SOFTPLUS_THRESHOLD, x, small)


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, given_ptr, weights_ptr, ids_ptr, stride_t, stride_given, scaling,
    E: tl.constexpr, G: tl.constexpr, PER_GROUP: tl.constexpr, BG: tl.constexpr, BPG: tl.constexpr,
    TOP_K: tl.constexpr, BK: tl.constexpr, TOPK_GROUPS: tl.constexpr, SCORING: tl.constexpr,
    HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr, TOP2_GROUPS: tl.constexpr, NORMALIZE: tl.constexpr,
    HASH: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    groups = tl.arange(0, BG)[:, None]
    members = tl.arange(0, BPG)[None, :]
    valid = (groups < G) & (members < PER_GROUP)
    expert = groups * PER_GROUP + members  # [BG, BPG] expert ids
    x = tl.load(logits_ptr + t * stride_t + expert, mask=valid, other=NEG_INF).to(tl.float32)
    if SCORING == 0:  # softmax
        e = tl.exp(x - tl.max(tl.max(x, axis=1), axis=0))
        scores = e / tl.sum(tl.sum(e, axis=1), axis=0)
    elif SCORING == 1:  # sigmoid
        scores = tl.where(valid, 1.0 / (1.0 + tl.exp(-x)), 0.0)
    else:  # sqrtsoftplus (V4)
        scores = tl.where(valid, tl.sqrt_rn(_log1p_exp(x)), 0.0)
    flat_scores = tl.reshape(scores, (BG * BPG,))
    flat_expert = tl.reshape(expert, (BG * BPG,))
    slots = tl.arange(0, BK)
    chosen_w = tl.zeros((BK,), dtype=tl.float32)
    chosen_id = tl.zeros((BK,), dtype=tl.int64)
    if HASH:  # the experts are given ([T, TOP_K]); their weights are their scores (no bias: nothing is chosen)
        chosen_id = tl.load(given_ptr + t * stride_given + slots, mask=slots < TOP_K, other=-1).to(tl.int64)
        for k in tl.static_range(TOP_K):
            given = tl.sum(tl.where(slots == k, chosen_id, 0), axis=0)
            here = flat_expert.to(tl.int64) == given
            chosen_w = tl.where(slots == k, tl.sum(tl.where(here, flat_scores, 0.0), axis=0), chosen_w)
    else:
        choice = scores
        if HAS_BIAS:
            choice = scores + tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
        choice = tl.where(valid, choice, NEG_INF)
        if GROUPED:
            best = tl.max(choice, axis=1)  # [BG]
            if TOP2_GROUPS:  # V3: a group ranks by the sum of its two best (bias-corrected) scores
                first = tl.argmin(tl.where(choice == best[:, None], members, BPG), axis=1)  # lowest index of best
                second = tl.max(tl.where(members == first[:, None], NEG_INF, choice), axis=1)
                rank = best + second
            else:
                rank = best
            rank = tl.where(tl.arange(0, BG) < G, rank, NEG_INF)
            kept = tl.zeros((BG,), dtype=tl.int1)
            for _ in tl.static_range(TOPK_GROUPS):
                g = tl.argmax(rank, axis=0)
                kept = kept | (tl.arange(0, BG) == g)
                rank = tl.where(tl.arange(0, BG) == g, NEG_INF, rank)
            choice = tl.where(kept[:, None], choice, NEG_INF)
        flat_choice = tl.reshape(choice, (BG * BPG,))
        positions = tl.arange(0, BG * BPG)
        for k in tl.static_range(TOP_K):
            at = tl.argmax(flat_choice, axis=0)
            here = positions == at
            chosen_w = tl.where(slots == k, tl.sum(tl.where(here, flat_scores, 0.0), axis=0), chosen_w)
            chosen_id = tl.where(slots == k, tl.sum(tl.where(here, flat_expert, 0), axis=0).to(tl.int64), chosen_id)
            flat_choice = tl.where(here, NEG_INF, flat_choice)
    if NORMALIZE:
        chosen_w = chosen_w / (tl.sum(chosen_w, axis=0) + 1e-20)
    tl.store(weights_ptr + t * TOP_K + slots, chosen_w * scaling, mask=slots < TOP_K)
    tl.store(ids_ptr + t * TOP_K + slots, chosen_id, mask=slots < TOP_K)


def moe_route(
    router_logits: torch.Tensor,
    config: RoutingConfig,
    correction_bias: torch.Tensor | None = None,
    expert_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64), the contract's routing.

    method "hash": the experts are `expert_ids` [T, k] (any integer dtype), returned as int64; their
    weights are their scores, normalized and scaled as configured. One launch either way, no host reads."""
    tokens, experts = router_logits.shape
    hashed = config.method == "hash"
    if hashed and expert_ids is None:
        raise ValueError("hash routing needs expert_ids (the token id -> experts table's rows)")
    grouped = config.method not in ("greedy", "hash") and config.num_groups > 1
    groups = config.num_groups if grouped else 1
    per_group = experts // groups
    weights = torch.empty((tokens, config.top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((tokens, config.top_k), dtype=torch.int64, device=router_logits.device)
    if tokens == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    bias = correction_bias.contiguous() if correction_bias is not None and not hashed else logits
    given = expert_ids if hashed else ids
    if given.stride(-1) != 1:
        given = given.contiguous()
    _route_kernel[(tokens,)](
        logits, bias, given, weights, ids, logits.stride(0), given.stride(0), config.routed_scaling_factor,
        E=experts, G=groups, PER_GROUP=per_group, BG=next_pow2(groups), BPG=next_pow2(per_group),
        TOP_K=config.top_k, BK=next_pow2(config.top_k), TOPK_GROUPS=config.topk_groups,
        SCORING=SCORINGS[config.scoring], HAS_BIAS=correction_bias is not None and not hashed, GROUPED=grouped,
        TOP2_GROUPS=config.method == "noaux_tc", NORMALIZE=config.normalize, HASH=hashed,
    )  # fmt: skip
    return weights, ids
