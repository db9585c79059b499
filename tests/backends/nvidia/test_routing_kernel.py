"""The fused routing kernel chooses the reference's experts with the reference's weights, for every routing
method and group layout (DeepSeek V2 and V3 shapes included), under Triton's interpreter."""

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
        num_experts=256, top_k=8, method="noaux_tc", scoring="sigmoid", num_groups=8, topk_groups=4,
        normalize=True, routed_scaling_factor=2.5,
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
