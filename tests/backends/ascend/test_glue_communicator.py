"""McDistributeCommunicator (npu_moe_distribute_dispatch / _combine) at world size 1 against core's
InProcessCommunicator: the same rows per expert, the same counts, the same combined sums.

These are glue tests on CPU against a fake torch_npu written from its documentation — not evidence that the
backend runs on Ascend hardware. The fake has one rank only (the MC2 ops are documented for 2-288 ranks;
the plugin uses this communicator only for world size > 1), so nothing here exercises the transport.
"""

from __future__ import annotations

import pytest
import torch
from fake_torch_npu import FakeTorchNpu

from deepinfer_ascend950.communicator import MAX_TOKENS_PER_CALL, McDistributeCommunicator
from deepinfer_ascend950.ops import AscendOps
from deepinfer_core.parallel.communicator import ExpertCommunicator, InProcessCommunicator
from deepinfer_core.reference.ops import ReferenceOps

REF = ReferenceOps()


def routing(tokens: int, experts: int, top_k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(tokens, experts, generator=g)
    ids = scores.topk(top_k, dim=-1).indices  # distinct experts per token, as moe_route gives
    weights = torch.rand(tokens, top_k, generator=g) + 0.1
    return ids, weights


def expert_weights(experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.2).to(dtype)
    return w13, w2


def rows_by_expert(hidden: torch.Tensor, counts: torch.Tensor) -> list[list[tuple]]:
    """Each expert's rows as a sorted list: the order of rows within an expert is not documented for MC2."""
    groups, start = [], 0
    for count in counts.tolist():
        groups.append(sorted(tuple(row) for row in hidden[start : start + count].float().tolist()))
        start += count
    return groups


def test_is_an_expert_communicator():
    comm = McDistributeCommunicator(FakeTorchNpu(), "ep_group", 1, 0)
    assert isinstance(comm, ExpertCommunicator) and comm.world_size == 1 and comm.rank == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dispatch_and_combine_match_in_process(dtype):
    tokens, hidden, experts, top_k = 24, 64, 8, 3
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    ids, weights = routing(tokens, experts, top_k, seed=2)
    npu = FakeTorchNpu()
    mc2, ref = McDistributeCommunicator(npu, "ep_group", 1, 0), InProcessCommunicator()
    got, want = mc2.dispatch(x, ids, experts), ref.dispatch(x, ids, experts)
    assert got.tokens_per_expert.dtype == torch.int64
    assert torch.equal(got.tokens_per_expert, want.tokens_per_expert)
    assert got.hidden.shape == want.hidden.shape and got.hidden.dtype == dtype
    assert rows_by_expert(got.hidden, got.tokens_per_expert) == rows_by_expert(want.hidden, want.tokens_per_expert)
    # each row's expert output depends only on the row and its expert, so the combined sums must agree
    w13, w2 = expert_weights(experts, hidden, 16, dtype, seed=3)
    out = mc2.combine(REF.expert_ffn(got.hidden, got.tokens_per_expert, w13, w2), got, weights)
    expected = ref.combine(REF.expert_ffn(want.hidden, want.tokens_per_expert, w13, w2), want, weights)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    ulp = torch.finfo(dtype).eps * expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), rtol=1e-2, atol=2 * ulp)
    [dispatch] = npu.calls_of("npu_moe_distribute_dispatch")
    assert dispatch.args["expert_ids"].dtype == torch.int32 and dispatch.args["expert_token_nums_type"] == 1
    [combine] = npu.calls_of("npu_moe_distribute_combine")
    assert combine.args["expert_scales"].dtype == torch.float32


def test_moe_layer_path_matches_reference():
    """dispatch -> AscendOps.expert_ffn -> combine, as MoE.__call__ runs it, against the reference pipeline."""
    tokens, hidden, experts, top_k = 30, 32, 6, 2
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(4)).bfloat16()
    ids, weights = routing(tokens, experts, top_k, seed=5)
    w13, w2 = expert_weights(experts, hidden, 16, torch.bfloat16, seed=6)
    npu = FakeTorchNpu()
    comm = McDistributeCommunicator(npu, "ep_group", 1, 0)
    d = comm.dispatch(x, ids, experts)
    out = comm.combine(AscendOps(npu).expert_ffn(d.hidden, d.tokens_per_expert, w13, w2), d, weights)
    ref = InProcessCommunicator()
    r = ref.dispatch(x, ids, experts)
    expected = ref.combine(REF.expert_ffn(r.hidden, r.tokens_per_expert, w13, w2), r, weights)
    ulp = torch.finfo(torch.bfloat16).eps * expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=3 * ulp)


def test_deepseek_v3_shapes_within_ascend950_limits():
    """H 7168 and K 8 are what the Ascend 950DT doc of aclnnMoeDistributeDispatch accepts."""
    tokens, hidden, experts, top_k = 8, 7168, 16, 8
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(7)).bfloat16()
    ids, weights = routing(tokens, experts, top_k, seed=8)
    comm = McDistributeCommunicator(FakeTorchNpu(profile="ascend950"), "ep_group", 1, 0)
    d = comm.dispatch(x, ids, experts)
    out = comm.combine(d.hidden, d, weights)  # identity experts: out[t] = sum_k w[t, k] * x[t]
    expected = (x.float() * weights.sum(dim=1, keepdim=True)).bfloat16()
    ulp = torch.finfo(torch.bfloat16).eps * expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2 * ulp)


def test_dispatch_of_a_prefill_sized_step():
    tokens, hidden, experts, top_k = 600, 32, 8, 2
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(9)).bfloat16()
    ids, weights = routing(tokens, experts, top_k, seed=10)
    comm = McDistributeCommunicator(FakeTorchNpu(), "ep_group", 1, 0)
    d = comm.dispatch(x, ids, experts)  # sent in chunks of at most MAX_TOKENS_PER_CALL tokens
    assert len(comm.npu.calls_of("npu_moe_distribute_dispatch")) == -(-tokens // MAX_TOKENS_PER_CALL)
    want = InProcessCommunicator().dispatch(x, ids, experts)  # the chunks' rows regrouped by expert
    assert torch.equal(d.tokens_per_expert.cpu(), want.tokens_per_expert)
    assert rows_by_expert(d.hidden, d.tokens_per_expert) == rows_by_expert(want.hidden, want.tokens_per_expert)
    # experts that scale their rows by (expert id + 1): a row regrouped under the wrong expert shows
    scale = torch.repeat_interleave(torch.arange(1, experts + 1), d.tokens_per_expert.cpu())[:, None]
    out = comm.combine((d.hidden.float() * scale).bfloat16(), d, weights)
    per_pair = (ids + 1).float() * weights  # [T, K]
    torch.testing.assert_close(out.float(), x.float() * per_pair.sum(dim=1, keepdim=True), rtol=2e-2, atol=2e-1)
