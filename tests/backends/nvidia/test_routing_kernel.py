"""The fused routing kernel chooses the reference's experts with the reference's weights, for every routing
method, scoring and group layout (DeepSeek V2, V3 and V4 shapes included: V4's sqrtsoftplus scores and its
hash routing, the experts given per token), under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.backend.ops import RoutingConfig
from deepinfer_core.reference.ops import ReferenceOps
from deepinfer_nvidia_sm100.ops import NvidiaOps

CONFIGS = {
    "greedy_softmax": RoutingConfig(num_experts=16, top_k=4),
    "greedy_sigmoid_normalized": RoutingConfig(num_experts=16, top_k=2, scoring="sigmoid", normalize=True),
    "group_limited_greedy": RoutingConfig(
        num_experts=16, top_k=4, method="group_limited_greedy", num_groups=4, topk_groups=2, routed_scaling_factor=1.5
    ),
    "noaux_tc": RoutingConfig(
        num_experts=16, top_k=4, method="noaux_tc", scoring="sigmoid", num_groups=4, topk_groups=2, normalize=True
    ),
    "v2_lite_like": RoutingConfig(num_experts=64, top_k=6, method="noaux_tc", scoring="sigmoid", normalize=True),
    "v3": RoutingConfig(
        num_experts=256,
        top_k=8,
        method="noaux_tc",
        scoring="sigmoid",
        num_groups=8,
        topk_groups=4,
        normalize=True,
        routed_scaling_factor=2.5,
    ),  # fmt: skip
    "groups_not_a_power_of_two": RoutingConfig(
        num_experts=24, top_k=3, method="group_limited_greedy", num_groups=3, topk_groups=2
    ),
}


def chosen(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The k experts per token sorted by id (their order is free), with their weights."""
    order = ids.argsort(dim=1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("tokens", [1, 37])
def test_routing_matches_reference(name, tokens):
    config = CONFIGS[name]
    g = torch.Generator().manual_seed(tokens)
    logits = torch.randn(tokens, config.num_experts, generator=g) * 2
    bias = torch.randn(config.num_experts, generator=g) * 0.5 if config.method == "noaux_tc" else None
    our_w, our_ids = chosen(*NvidiaOps().moe_route(logits, config, bias))
    ref_w, ref_ids = chosen(*ReferenceOps().moe_route(logits, config, bias))
    assert torch.equal(our_ids, ref_ids)
    torch.testing.assert_close(our_w, ref_w, rtol=1.3e-6, atol=1e-6)


def test_bias_chooses_but_does_not_weigh():
    """A large bias on expert 0 makes it chosen everywhere, but its weight stays its raw score."""
    config = RoutingConfig(num_experts=8, top_k=2, method="noaux_tc", scoring="sigmoid", num_groups=2, topk_groups=1)
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    bias = torch.zeros(8)
    bias[0] = 100.0
    weights, ids = NvidiaOps().moe_route(logits, config, bias)
    assert (ids == 0).any(dim=1).all()
    at = (ids == 0).int().argmax(dim=1)
    assert torch.allclose(weights[torch.arange(5), at], logits[:, 0].sigmoid())


# ----------------------------------------------------------------------------- DeepSeek-V4 routing

V4_CONFIGS = {
    # V4's top-k layers: greedy over bias-corrected sqrtsoftplus scores, weighted by the raw ones
    "v4_topk": RoutingConfig(
        num_experts=16, top_k=4, scoring="sqrtsoftplus", normalize=True, routed_scaling_factor=1.5
    ),
    "sqrtsoftplus_plain": RoutingConfig(num_experts=16, top_k=6, scoring="sqrtsoftplus"),
    "sqrtsoftplus_noaux_tc": RoutingConfig(
        num_experts=16, top_k=4, method="noaux_tc", scoring="sqrtsoftplus", num_groups=4, topk_groups=2, normalize=True
    ),
    "v4_flash_like": RoutingConfig(
        num_experts=256, top_k=6, scoring="sqrtsoftplus", normalize=True, routed_scaling_factor=1.5
    ),
}


@pytest.mark.parametrize("biased", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("name", list(V4_CONFIGS))
@pytest.mark.parametrize("tokens", [1, 37])
def test_sqrtsoftplus_routing_matches_reference(name, tokens, biased):
    config = V4_CONFIGS[name]
    g = torch.Generator().manual_seed(100 + tokens)
    logits = torch.randn(tokens, config.num_experts, generator=g) * 2
    # a bias comparable to the spread of the scores: the chosen set differs from the one by raw score
    bias = torch.randn(config.num_experts, generator=g) * 0.5 if biased else None
    our_w, our_ids = chosen(*NvidiaOps().moe_route(logits, config, bias))
    ref_w, ref_ids = chosen(*ReferenceOps().moe_route(logits, config, bias))
    assert torch.equal(our_ids, ref_ids)
    torch.testing.assert_close(our_w, ref_w, rtol=1.3e-6, atol=1e-6)


def test_sqrtsoftplus_scores_over_the_whole_range():
    """Every expert chosen, so the weights are the scores: softplus is x above 20 (torch's threshold) and
    log1p(exp(x)) below, accurate for tiny exp(x), finite for huge x."""
    logits = torch.tensor([[-100.0, -30.0, -20.0, -5.0, -1e-3, 0.0, 5.0, 19.9, 20.0, 20.5, 100.0, 3e38]])
    config = RoutingConfig(num_experts=logits.shape[1], top_k=logits.shape[1], scoring="sqrtsoftplus")
    our_w, our_ids = chosen(*NvidiaOps().moe_route(logits, config))
    ref_w, ref_ids = chosen(*ReferenceOps().moe_route(logits, config))
    assert torch.equal(our_ids, ref_ids) and torch.isfinite(our_w).all()
    torch.testing.assert_close(our_w, ref_w, rtol=1.3e-6, atol=0.0)


def hash_table(tokens: int, config: RoutingConfig, logits: torch.Tensor, seed: int) -> torch.Tensor:
    """[T, K] distinct experts per token, in half the rows the K worst by logit (routing by score would differ)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(config.num_experts, generator=g)[: config.top_k] for _ in range(tokens)])
    ids[::2] = logits[::2].argsort(dim=1)[:, : config.top_k]
    return ids


@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "softmax", "sigmoid"])
@pytest.mark.parametrize("tokens", [1, 37])
def test_hash_routing_weighs_the_given_experts(tokens, scoring, ids_dtype):
    config = RoutingConfig(16, 4, "hash", scoring, normalize=True, routed_scaling_factor=1.5)
    logits = torch.randn(tokens, 16, generator=torch.Generator().manual_seed(tokens)) * 2
    table = hash_table(tokens, config, logits, seed=5)
    bias = torch.randn(16, generator=torch.Generator().manual_seed(6))  # V4 checkpoints may carry one: unused
    our_w, our_ids = NvidiaOps().moe_route(logits, config, bias, expert_ids=table.to(ids_dtype))
    ref_w, ref_ids = ReferenceOps().moe_route(logits, config, bias, expert_ids=table)
    assert our_ids.dtype == torch.int64 and torch.equal(our_ids, table)  # the given experts, in the given order
    torch.testing.assert_close(our_w, ref_w, rtol=1.3e-6, atol=1e-6)


def test_hash_routing_unnormalized_on_strided_views():
    """Unnormalized weights are the raw scores times the scaling; logits and ids may be views."""
    config = RoutingConfig(8, 2, "hash", "sqrtsoftplus", routed_scaling_factor=2.5)
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(5, 16, generator=g) * 2)[:, ::2]  # [5, 8], unit stride lost
    table = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(5)])
    strided = torch.stack([table, table], dim=2)[..., 0]  # [5, 2], last stride 2
    our_w, our_ids = NvidiaOps().moe_route(logits, config, expert_ids=strided)
    assert torch.equal(our_ids, table)
    torch.testing.assert_close(our_w, 2.5 * torch.nn.functional.softplus(logits).sqrt().gather(1, table))


def test_hash_routing_needs_the_table():
    with pytest.raises(ValueError, match="expert_ids"):
        NvidiaOps().moe_route(torch.zeros(2, 8), RoutingConfig(8, 2, "hash", "sqrtsoftplus"))
