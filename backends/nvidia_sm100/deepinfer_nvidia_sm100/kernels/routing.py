"""MoE routing in one kernel (one program per token) in place of a dozen tensor ops: scores (softmax or
sigmoid), the correction bias for choosing, the group filter (V2's best expert, V3's two best), the
top-k experts by repeated argmax, and the weights (raw scores, normalized, scaled). Row-local, so
batch-invariant; exact ties go to the lower expert id (the contract leaves ties free)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.backend.ops import RoutingConfig
from deepinfer_nvidia_sm100.kernels._common import next_pow2

NEG_INF = tl.constexpr(float("-inf"))  # a global a kernel reads must be a constexpr


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_t, scaling,
    E: tl.constexpr, G: tl.constexpr, PER_GROUP: tl.constexpr, BG: tl.constexpr, BPG: tl.constexpr,
    TOP_K: tl.constexpr, BK: tl.constexpr, TOPK_GROUPS: tl.constexpr, SOFTMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr, TOP2_GROUPS: tl.constexpr, NORMALIZE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    groups = tl.arange(0, BG)[:, None]
    members = tl.arange(0, BPG)[None, :]
    valid = (groups < G) & (members < PER_GROUP)
    expert = groups * PER_GROUP + members  # [BG, BPG] expert ids
    x = tl.load(logits_ptr + t * stride_t + expert, mask=valid, other=NEG_INF).to(tl.float32)
    if SOFTMAX:
        e = tl.exp(x - tl.max(tl.max(x, axis=1), axis=0))
        scores = e / tl.sum(tl.sum(e, axis=1), axis=0)
    else:
        scores = tl.where(valid, 1.0 / (1.0 + tl.exp(-x)), 0.0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, NEG_INF)
    if GROUPED:
        best = tl.max(choice, axis=1)  # [BG]
        if TOP2_GROUPS:  # V3: a group ranks by the sum of its two best (bias-corrected) scores
            first = tl.argmin(tl.where(choice == best[:, None], members, BPG), axis=1)  # lowest index of the best
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
    flat_scores = tl.reshape(scores, (BG * BPG,))
    flat_expert = tl.reshape(expert, (BG * BPG,))
    positions = tl.arange(0, BG * BPG)
    slots = tl.arange(0, BK)
    chosen_w = tl.zeros((BK,), dtype=tl.float32)
    chosen_id = tl.zeros((BK,), dtype=tl.int64)
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
    router_logits: torch.Tensor, config: RoutingConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64), the contract's routing."""
    tokens, experts = router_logits.shape
    grouped = config.method != "greedy" and config.num_groups > 1
    groups = config.num_groups if grouped else 1
    per_group = experts // groups
    weights = torch.empty((tokens, config.top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((tokens, config.top_k), dtype=torch.int64, device=router_logits.device)
    if tokens == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    bias = correction_bias.contiguous() if correction_bias is not None else logits
    _route_kernel[(tokens,)](
        logits, bias, weights, ids, logits.stride(0), config.routed_scaling_factor,
        E=experts, G=groups, PER_GROUP=per_group, BG=next_pow2(groups), BPG=next_pow2(per_group),
        TOP_K=config.top_k, BK=next_pow2(config.top_k), TOPK_GROUPS=config.topk_groups,
        SOFTMAX=config.scoring == "softmax", HAS_BIAS=correction_bias is not None, GROUPED=grouped,
        TOP2_GROUPS=config.method == "noaux_tc", NORMALIZE=config.normalize,
    )  # fmt: skip
    return weights, ids
