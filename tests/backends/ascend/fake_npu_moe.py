# ruff: noqa: E501  (each op's docstring opens with its torch_npu schema line, verbatim)
"""Part of the documentation-based fake torch_npu (fake_torch_npu.py): the MoE ops npu_moe_gating_top_k and npu_grouped_matmul."""

from __future__ import annotations

import torch
from fake_npu_common import FLOATS, DocViolation, _require, _unsupported_by_fake


def npu_moe_gating_top_k(
    self,
    x,
    k,
    *,
    bias=None,
    input_ids=None,
    tid2eid=None,
    k_group=1,
    group_count=1,
    group_select_mode=0,
    renorm=0,
    norm_type=0,
    out_flag=False,
    routed_scaling_factor=1.0,
    eps=1e-20,
):
    """npu_moe_gating_top_k(Tensor x, int k, *, Tensor? bias=None, Tensor? input_ids=None, Tensor? tid2eid=None, int k_group=1, int group_count=1, int group_select_mode=0, int renorm=0, int norm_type=0, bool out_flag=False, float routed_scaling_factor=1.0, float eps=1e-20) -> (Tensor, Tensor, Tensor)

    [OPS] (aclnnMoeGatingTopK.md and its golden.py, which list Ascend 950):
      normOut = softmax(x) (norm_type 0) | sigmoid(x) (1); value = normOut + bias (bias only for choosing)
      group_count > 1: group score = max (group_select_mode 0) | sum of the top 2 (1) of each group of
      `value`; keep the k_group best groups (ties: lower index first), the rest -inf
      expert_idx = top-k of value (stable, descending), int32
      y = normOut gathered at expert_idx; divided by (sum(y) + eps) when norm_type == 1 or renorm == 1;
      times routed_scaling_factor; in x's dtype. Third output: normOut (float32) when out_flag.
      hash routing (input_ids, tid2eid): expert_idx = tid2eid[input_ids].
    Constraints: x 2-D, E <= 2048; bias 1-D [E] with x's dtype; 1 <= k_group <= group_count;
    E % group_count == 0 and E / group_count > group_select_mode (the older torch_npu doc [PTA] says
    "> 2"; the fake follows the newer [OPS] text); ceil32(E / group_count) * group_count <= 2048;
    1 <= k <= E / group_count * k_group; renorm in {0, 1}; norm_type in {0, 1} (2 is 950-only, not
    implemented). ASSUMPTION: the third output when out_flag is False holds NaN here (the docs say it
    is not output; [META] still allocates [T, E]), so a caller that reads it shows up.
    """
    op = "npu_moe_gating_top_k"
    self._record(op, locals())
    _require(x.dim() == 2, op, f"x must be 2-D, got shape {tuple(x.shape)}")
    _require(x.dtype in FLOATS, op, f"x dtype {x.dtype} is not float16/bfloat16/float32")
    _require(x.numel() > 0, op, "empty tensors are not supported")
    tokens, experts = x.shape
    _require(experts <= 2048, op, f"at most 2048 experts, got {experts}")
    _require(
        group_count > 0 and experts % group_count == 0,
        op,
        f"{experts} experts do not split into {group_count} groups",
    )
    per_group = experts // group_count
    _require(
        per_group > group_select_mode,
        op,
        f"groups of {per_group} are too small for group_select_mode {group_select_mode}",
    )
    _require(-(-per_group // 32) * 32 * group_count <= 2048, op, "groups aligned to 32 experts exceed 2048")
    _require(1 <= k_group <= group_count, op, f"k_group must be in 1..group_count ({group_count}), got {k_group}")
    _require(1 <= k <= per_group * k_group, op, f"k must be in 1..{per_group * k_group}, got {k}")
    _require(group_select_mode in (0, 1), op, f"group_select_mode must be 0 or 1, got {group_select_mode}")
    _require(renorm in (0, 1), op, f"renorm must be 0 or 1, got {renorm}")
    if norm_type == 2:
        raise _unsupported_by_fake(op, "norm_type 2 (sqrt-softplus, Ascend 950 only)")
    _require(norm_type in (0, 1), op, f"norm_type must be 0 (softmax) or 1 (sigmoid), got {norm_type}")
    if bias is not None:
        _require(bias.dim() == 1 and bias.shape[0] == experts, op, f"bias must be [{experts}], got {tuple(bias.shape)}")
        _require(bias.dtype == x.dtype, op, f"bias dtype {bias.dtype} must equal x's {x.dtype}")
    _require((input_ids is None) == (tid2eid is None), op, "input_ids and tid2eid go together")
    scores = x.float().softmax(dim=-1) if norm_type == 0 else x.float().sigmoid()
    value = scores if bias is None else scores + bias.float()
    if tid2eid is not None:
        _require(input_ids.shape == (tokens,) and tid2eid.shape[1] == k, op, "input_ids [T], tid2eid [V, k]")
        idx = tid2eid[input_ids.long()].long()
    else:
        if group_count > 1:
            grouped = value.view(tokens, group_count, per_group)
            if group_select_mode == 0:
                group_score = grouped.amax(dim=-1)
            else:
                group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)
            kept = torch.sort(group_score, dim=-1, descending=True, stable=True).indices[:, :k_group]
            dropped = torch.ones(tokens, group_count, dtype=torch.bool).scatter_(1, kept, False)
            value = grouped.masked_fill(dropped[:, :, None], float("-inf")).view(tokens, experts)
        idx = torch.sort(value, dim=-1, descending=True, stable=True).indices[:, :k]
    y = scores.gather(1, idx)
    if norm_type == 1 or renorm == 1:
        y = y / (y.sum(dim=-1, keepdim=True) + eps)
    y = (y * routed_scaling_factor).to(x.dtype)
    norm_out = scores if out_flag else torch.full_like(scores, float("nan"))
    return y, idx.to(torch.int32), norm_out


def npu_grouped_matmul(
    self,
    x,
    weight,
    *,
    bias=None,
    scale=None,
    offset=None,
    antiquant_scale=None,
    antiquant_offset=None,
    per_token_scale=None,
    group_list=None,
    activation_input=None,
    activation_quant_scale=None,
    activation_quant_offset=None,
    split_item=0,
    group_type=None,
    group_list_type=0,
    act_type=0,
    tuning_config=None,
    output_dtype=None,
    x_dtype=None,
    weight_dtype=None,
    scale_dtype=None,
    per_token_scale_dtype=None,
):
    """npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, Tensor[]? per_token_scale=None, Tensor? group_list=None, Tensor[]? activation_input=None, Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None, int? split_item=0, int? group_type=None, int? group_list_type=0, int? act_type=0, int[]? tuning_config=None, int? output_dtype=None, int? x_dtype=None, int? weight_dtype=None, int? scale_dtype=None, int? per_token_scale_dtype=None) -> Tensor[]

    [PTA] Implemented: the non-quantized "single-single-single" m-axis grouping (group_type 0): one x
    [M, K], one weight [E, K, N] (it may be a transposed view: "支持weight转置"; x may not be), one
    output [M, N] (split_item 2 or 3) whose rows of group e are x's rows of group e times weight[e].
    group_list: a 1-D int64 Tensor of length E (<= 1024): cumulative ends (group_list_type 0,
    non-decreasing, last == M) or counts (type 1: non-negative, sum == M, "长度不能为1"); type 2 only
    for int8. x and weight share a dtype (float16/bfloat16/float32); the output has x's dtype; the
    inner dims stay below 65536.
    """
    op = "npu_grouped_matmul"
    self._record(op, locals())
    quant = dict(
        bias=bias, scale=scale, offset=offset, antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset,
        per_token_scale=per_token_scale, activation_input=activation_input,
        activation_quant_scale=activation_quant_scale, activation_quant_offset=activation_quant_offset,
        tuning_config=tuning_config, x_dtype=x_dtype, weight_dtype=weight_dtype, scale_dtype=scale_dtype,
        per_token_scale_dtype=per_token_scale_dtype,
    )  # fmt: skip
    for name, value in quant.items():
        if value is not None:
            raise _unsupported_by_fake(op, name)
    if act_type:
        raise _unsupported_by_fake(op, f"act_type {act_type}")
    _require(isinstance(x, (list, tuple)) and isinstance(weight, (list, tuple)), op, "x and weight are lists")
    _require(0 < len(x) <= 128 and 0 < len(weight) <= 128, op, "x and weight lists hold 1-128 tensors")
    if not (len(x) == 1 and len(weight) == 1 and weight[0].dim() == 3 and group_type == 0):
        raise _unsupported_by_fake(op, "anything but single x, single 3-D weight, group_type 0")
    _require(split_item in (2, 3), op, f"single-single-single needs split_item 2 or 3, got {split_item}")
    xs, w = x[0], weight[0]
    _require(xs.dim() == 2, op, f"x must be 2-D, got {tuple(xs.shape)}")
    _require(
        xs.dtype in FLOATS and w.dtype == xs.dtype,
        op,
        f"x {xs.dtype} and weight {w.dtype} must share a float dtype",
    )
    _require(output_dtype is None or output_dtype == xs.dtype, op, "output_dtype must be None or x's dtype")
    rows, inner = xs.shape
    experts, w_inner, n = w.shape
    _require(w_inner == inner, op, f"x [.., {inner}] does not match weight [{experts}, {w_inner}, {n}]")
    transposed_x = rows > 1 and inner > 1 and xs.stride() == (1, rows)
    _require(not transposed_x, op, "x may not be transposed")
    _require(
        w.is_contiguous() or w.transpose(1, 2).is_contiguous(),
        op,
        "weight must be contiguous or a transposed [E, N, K]",
    )
    _require(inner < 65536 and n < 65536, op, "inner dims must stay below 65536")
    _require(isinstance(group_list, torch.Tensor), op, "group_list must be a Tensor for group_type 0")
    _require(group_list.dim() == 1 and group_list.dtype == torch.int64, op, "group_list must be 1-D int64")
    _require(group_list.shape[0] == experts, op, f"group_list has {group_list.shape[0]} entries for {experts} groups")
    _require(experts <= 1024, op, f"at most 1024 groups, got {experts}")
    values = group_list.tolist()
    _require(all(v >= 0 for v in values), op, f"group_list must be non-negative, got {values}")
    if group_list_type == 0:
        _require(
            values == sorted(values) and values[-1] == rows,
            op,
            f"cumulative group_list {values} must end at {rows}",
        )
        counts = [b - a for a, b in zip([0] + values[:-1], values)]
    elif group_list_type == 1:
        _require(len(values) != 1, op, "a group_list of counts (group_list_type 1) may not have length 1")
        _require(sum(values) == rows, op, f"group_list counts {values} must sum to x's {rows} rows")
        counts = values
    else:
        raise DocViolation(f"{op}: group_list_type {group_list_type} is only documented for int8 x and weight")
    out = xs.new_empty((rows, n))
    start = 0
    for e, count in enumerate(counts):
        if count:
            out[start : start + count] = (xs[start : start + count].float() @ w[e].float()).to(xs.dtype)
        start += count
    return [out]
