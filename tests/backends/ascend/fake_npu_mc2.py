# ruff: noqa: E501  (each op's docstring opens with its torch_npu schema line, verbatim)
"""Part of the documentation-based fake torch_npu (fake_torch_npu.py): the one-rank MC2 ops npu_moe_distribute_dispatch and npu_moe_distribute_combine."""

from __future__ import annotations

import torch
from fake_npu_common import HALVES, _require, _unsupported_by_fake


def _mc2_common(self, op, bs, h, k, ep_world_size, ep_rank_id, moe_expert_num, group_ep, shared_rank_num):
    _require(isinstance(group_ep, str) and 1 <= len(group_ep) < 128, op, "group_ep must be a 1-127 character name")
    _require(0 <= ep_rank_id < ep_world_size, op, f"ep_rank_id {ep_rank_id} not in [0, {ep_world_size})")
    _require(1 <= moe_expert_num <= 512, op, f"moe_expert_num must be in [1, 512], got {moe_expert_num}")
    _require(
        moe_expert_num % (ep_world_size - shared_rank_num) == 0,
        op,
        "moe_expert_num must split evenly over the MoE ranks",
    )
    _require(0 < k <= moe_expert_num, op, f"K must be in 1..moe_expert_num, got {k}")
    _require(0 < bs <= 512, op, f"BS must be in [1, 512] (256 on Atlas A2), got {bs}")
    if ep_world_size != 1:
        raise _unsupported_by_fake(
            op, f"ep_world_size {ep_world_size}: the fake has one rank only (the docs list 2-288 ranks, never 1)"
        )
    if self.profile == "ascend950":  # [OPS] aclnnMoeDistributeDispatch.md, Ascend 950DT
        _require(h == 7168, op, f"H must be 7168, got {h}")
        _require(k <= 8, op, f"K must be in [1, 8], got {k}")
    elif self.profile == "atlas_a2_a3":  # [PTA], Atlas A2 (the looser of A2 / A3)
        _require(0 < h <= 7168 and h % 32 == 0, op, f"H must be a multiple of 32 in (0, 7168], got {h}")
        _require(k <= 16, op, f"K must be in [1, 16], got {k}")


def _check_expert_ids(op, expert_ids, bs, moe_expert_num):
    _require(expert_ids.dim() == 2 and expert_ids.shape[0] == bs, op, f"expert_ids must be [{bs}, K]")
    _require(expert_ids.dtype == torch.int32, op, f"expert_ids must be int32, got {expert_ids.dtype}")
    ids = expert_ids.long()
    _require(bool(((ids >= 0) & (ids < moe_expert_num)).all()), op, f"expert ids must be in [0, {moe_expert_num})")
    _require(bool((ids.sort(dim=1).values.diff(dim=1) != 0).all()), op, "the K expert ids of a token must differ")


def npu_moe_distribute_dispatch(
    self,
    x,
    expert_ids,
    group_ep,
    ep_world_size,
    ep_rank_id,
    moe_expert_num,
    *,
    scales=None,
    x_active_mask=None,
    expert_scales=None,
    group_tp="",
    tp_world_size=0,
    tp_rank_id=0,
    expert_shard_type=0,
    shared_expert_num=1,
    shared_expert_rank_num=0,
    quant_mode=0,
    global_bs=0,
    expert_token_nums_type=1,
):
    """npu_moe_distribute_dispatch(Tensor x, Tensor expert_ids, str group_ep, int ep_world_size, int ep_rank_id, int moe_expert_num, *, Tensor? scales=None, Tensor? x_active_mask=None, Tensor? expert_scales=None, str group_tp="", int tp_world_size=0, int tp_rank_id=0, int expert_shard_type=0, int shared_expert_num=1, int shared_expert_rank_num=0, int quant_mode=0, int global_bs=0, int expert_token_nums_type=1) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)

    ONE RANK ONLY (ep_world_size 1, which the docs never list: 16/32/64 on A2, 8-288 on A3, 2-288 on
    950DT). Documented [PTA][OPS]: x [BS, H] float16/bfloat16, 0 < BS <= 512; expert_ids [BS, K] int32
    in [0, moe_expert_num), distinct per row; moe_expert_num in [1, 512] and divisible by the MoE
    ranks; outputs (expand_x [A, H] in x's dtype, A >= BS * W * min(local experts, K) [META];
    dynamic_scales [A] float32, only meaningful for quant_mode 2; expand_idx [BS * K] int32;
    expert_token_nums [local experts] int64: counts (type 1) or their running sum (type 0);
    ep_recv_counts int32 (running sums of rows received per expert and rank); tp_recv_counts
    [tp_world_size] int32; expand_scales float32, [0] without expert_scales).
    ASSUMPTIONS (the docs say "the values of expand_idx, ep_recv_counts, tp_recv_counts, expand_scales
    may differ between products; pass them to combine unchanged"): at one rank expand_x holds the
    (token, k) rows sorted by expert, then token, then k (A = BS * K); expand_idx[t * K + k] is the row
    of expand_x holding pair (t, k); ep_recv_counts = running sum of the per-expert counts.
    """
    op = "npu_moe_distribute_dispatch"
    self._record(op, locals())
    for name, v in dict(scales=scales, x_active_mask=x_active_mask).items():
        if v is not None:
            raise _unsupported_by_fake(op, name)
    if quant_mode:
        raise _unsupported_by_fake(op, f"quant_mode {quant_mode}")
    _require(x.dim() == 2, op, f"x must be 2-D, got {tuple(x.shape)}")
    _require(x.dtype in HALVES, op, f"x dtype {x.dtype} is not float16/bfloat16")
    bs, h = x.shape
    _require(expert_ids.dim() == 2, op, "expert_ids must be 2-D")
    k = expert_ids.shape[1]
    _mc2_common(self, op, bs, h, k, ep_world_size, ep_rank_id, moe_expert_num, group_ep, shared_expert_rank_num)
    _check_expert_ids(op, expert_ids, bs, moe_expert_num)
    _require(tp_world_size in (0, 1) and tp_rank_id == 0 and group_tp == "", op, "the fake has no TP domain")
    _require(expert_shard_type == 0, op, "expert_shard_type must be 0")
    _require(shared_expert_num in (0, 1) and shared_expert_rank_num == 0, op, "the fake has no shared-expert ranks")
    _require(
        # documented: 0 (every rank sends the same BS) or max BS over the ranks * ep_world_size
        global_bs == 0 or (global_bs % ep_world_size == 0 and global_bs >= bs * ep_world_size),
        op,
        f"global_bs must be 0 or (max BS over ranks) * ep_world_size, got {global_bs}",
    )
    _require(expert_token_nums_type in (0, 1), op, "expert_token_nums_type must be 0 or 1")
    flat = expert_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    expand_x = x[order // k]
    expand_idx = torch.empty_like(order)
    expand_idx[order] = torch.arange(order.numel())
    counts = torch.bincount(flat, minlength=moe_expert_num)
    expert_token_nums = counts if expert_token_nums_type == 1 else counts.cumsum(0)
    ep_recv_counts = counts.cumsum(0).to(torch.int32)
    tp_recv_counts = torch.zeros(tp_world_size, dtype=torch.int32)
    expand_scales = torch.zeros(0) if expert_scales is None else expert_scales.float().reshape(-1)[order]
    dynamic_scales = torch.zeros(expand_x.shape[0], dtype=torch.float32)
    return (expand_x, dynamic_scales, expand_idx.to(torch.int32), expert_token_nums.to(torch.int64),
            ep_recv_counts, tp_recv_counts, expand_scales)  # fmt: skip


def npu_moe_distribute_combine(
    self,
    expand_x,
    expert_ids,
    expand_idx,
    ep_send_counts,
    expert_scales,
    group_ep,
    ep_world_size,
    ep_rank_id,
    moe_expert_num,
    *,
    tp_send_counts=None,
    x_active_mask=None,
    activation_scale=None,
    weight_scale=None,
    group_list=None,
    expand_scales=None,
    shared_expert_x=None,
    group_tp="",
    tp_world_size=0,
    tp_rank_id=0,
    expert_shard_type=0,
    shared_expert_num=1,
    shared_expert_rank_num=0,
    global_bs=0,
    out_dtype=0,
    comm_quant_mode=0,
    group_list_type=0,
):
    """npu_moe_distribute_combine(Tensor expand_x, Tensor expert_ids, Tensor expand_idx, Tensor ep_send_counts, Tensor expert_scales, str group_ep, int ep_world_size, int ep_rank_id, int moe_expert_num, *, Tensor? tp_send_counts=None, Tensor? x_active_mask=None, Tensor? activation_scale=None, Tensor? weight_scale=None, Tensor? group_list=None, Tensor? expand_scales=None, Tensor? shared_expert_x=None, str group_tp="", int tp_world_size=0, int tp_rank_id=0, int expert_shard_type=0, int shared_expert_num=1, int shared_expert_rank_num=0, int global_bs=0, int out_dtype=0, int comm_quant_mode=0, int group_list_type=0) -> Tensor

    ONE RANK ONLY (see npu_moe_distribute_dispatch). [PTA]: the reverse path of dispatch, then
    out[t] = sum_k expert_scales[t, k] * row(t, k) ("乘权重再相加"), [BS, H] in expand_x's dtype;
    expand_x float16/bfloat16 [A, H]; expert_ids [BS, K] int32 (as dispatched); expand_idx [BS * K]
    int32 and ep_send_counts int32 are dispatch's expand_idx and ep_recv_counts; expert_scales
    [BS, K] float32. ASSUMPTIONS: the row of pair (t, k) is expand_x[expand_idx[t * K + k]] (dispatch's
    layout above); the k terms are summed in float32 in order k = 0, 1, ...; the fake checks that
    ep_send_counts is the running sum dispatch returned for these expert_ids.
    """
    op = "npu_moe_distribute_combine"
    self._record(op, locals())
    reserved = dict(x_active_mask=x_active_mask, activation_scale=activation_scale, weight_scale=weight_scale,
                    group_list=group_list, shared_expert_x=shared_expert_x)  # fmt: skip
    for name, v in reserved.items():
        _require(v is None, op, f"{name} is a reserved parameter; leave it None")
    if comm_quant_mode:
        raise _unsupported_by_fake(op, f"comm_quant_mode {comm_quant_mode}")
    _require(expand_x.dim() == 2 and expand_x.dtype in HALVES, op, "expand_x must be 2-D float16/bfloat16")
    _require(expert_ids.dim() == 2, op, "expert_ids must be 2-D")
    bs, k = expert_ids.shape
    h = expand_x.shape[1]
    _mc2_common(self, op, bs, h, k, ep_world_size, ep_rank_id, moe_expert_num, group_ep, shared_expert_rank_num)
    _check_expert_ids(op, expert_ids, bs, moe_expert_num)
    _require(expand_x.shape[0] >= bs * k, op, f"expand_x has {expand_x.shape[0]} rows, fewer than BS * K = {bs * k}")
    _require(
        expand_idx.dtype == torch.int32 and expand_idx.shape == (bs * k,),
        op,
        f"expand_idx must be [{bs * k}] int32",
    )
    _require(ep_send_counts.dtype == torch.int32 and ep_send_counts.dim() == 1, op, "ep_send_counts must be 1-D int32")
    expected = torch.bincount(expert_ids.reshape(-1).long(), minlength=moe_expert_num).cumsum(0)
    _require(torch.equal(ep_send_counts.long(), expected), op, "ep_send_counts is not dispatch's ep_recv_counts")
    _require(
        expert_scales.dtype == torch.float32 and expert_scales.shape == (bs, k),
        op,
        f"expert_scales must be [{bs}, {k}] float32",
    )
    _require(
        tp_send_counts is None or tp_send_counts.numel() == tp_world_size,
        op,
        "tp_send_counts must be dispatch's tp_recv_counts",
    )
    _require(tp_world_size in (0, 1) and tp_rank_id == 0 and group_tp == "", op, "the fake has no TP domain")
    _require(expert_shard_type == 0 and shared_expert_rank_num == 0, op, "the fake has no shared-expert ranks")
    _require(
        # documented: 0 (every rank sends the same BS) or max BS over the ranks * ep_world_size
        global_bs == 0 or (global_bs % ep_world_size == 0 and global_bs >= bs * ep_world_size),
        op,
        f"global_bs must be 0 or (max BS over ranks) * ep_world_size, got {global_bs}",
    )
    rows = expand_x[expand_idx.long()].float().view(bs, k, h)
    out = torch.zeros(bs, h, dtype=torch.float32)
    for j in range(k):
        out += expert_scales[:, j, None] * rows[:, j]
    return out.to(expand_x.dtype)
