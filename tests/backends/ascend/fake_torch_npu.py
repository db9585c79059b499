# ruff: noqa: E501  (each op's docstring opens with its torch_npu schema line, verbatim)
"""A stand-in for the `torch_npu` module, in plain torch on CPU, written from torch_npu's and CANN's documentation.

It implements exactly the nine torch_npu ops the ascend950 backend calls, with the Python signatures of
torch_npu 2.13's schema (npu_native_functions_by_codegen.yaml; `Tensor self` is `input`, as PyTorch's
Python bindings name it), computes in float32 and returns the input's dtype. It is for glue tests: it
checks the arguments the documentation constrains and raises `DocViolation` for combinations the
documentation forbids, so that misuse by the backend shows on CPU. It is NOT evidence that the backend
runs on Ascend hardware, and where the documentation is silent it says so (ASSUMPTION in the docstrings).

Sources (the hiascend.com pages mirror the op-plugin Markdown):
  [PTA]  torch_npu API docs, Ascend/op-plugin docs/context/torch_npu-<op>.md (Atlas A2/A3 products);
         hiascend.com ptaoplist_* pages for npu_swiglu, npu_rms_norm, npu_scatter_nd_update_.
  [OPS]  CANN ops-transformer docs, which list Ascend 950: moe/moe_gating_top_k/docs/aclnnMoeGatingTopK.md
         (+ tests/assets/golden.py), attention/fused_infer_attention_score/docs/
         aclnnFusedInferAttentionScoreV5.md (the only FIA version documented for Ascend 950; V3/V4 say
         "Ascend 950PR/Ascend 950DT: 不支持"), mc2/moe_distribute_dispatch/docs/aclnnMoeDistributeDispatch.md.
  [META] torch_npu 2.13 op_plugin/meta/_meta_registrations.py (output shapes and dtypes).

Checks come in two layers:
  * always: what the documentation states for every product (dtypes, shapes, required arguments,
    contiguity where the docs say "不支持非连续", value ranges, sparse_mode 3 needs the 2048 x 2048 mask);
  * `profile="ascend950"` / `profile="atlas_a2_a3"`: the documented size limits of those products
    (head dims, Q_S, BS, H, K, block sizes), which the small shapes of most glue tests would not meet.
`allow_float32_attention=True` lets npu_fused_infer_attention_score take float32 (the docs allow only
float16/bfloat16; the backend's Capabilities never offer float32, so this relaxation only serves the
float32 end-to-end comparison with the cpu backend).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["DocViolation", "FakeTorchNpu", "IMPLEMENTED_OPS", "PROFILES", "expect_violation"]

IMPLEMENTED_OPS = (
    "npu_rms_norm",
    "npu_rotary_mul",
    "npu_swiglu",
    "npu_moe_gating_top_k",
    "npu_grouped_matmul",
    "npu_scatter_nd_update_",
    "npu_fused_infer_attention_score",
    "npu_moe_distribute_dispatch",
    "npu_moe_distribute_combine",
)
PROFILES = (None, "ascend950", "atlas_a2_a3")
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
HALVES = (torch.float16, torch.bfloat16)
MASK_SIZE = 2048


class DocViolation(ValueError):
    """An argument combination that torch_npu's / CANN's documentation forbids."""


@contextmanager
def expect_violation(pattern: str):
    """For xfail(raises=DocViolation) tests: only the DocViolation whose message matches `pattern` gets through,
    so the test documents that one limit and fails on any other."""
    try:
        yield
    except DocViolation as err:
        if not re.search(pattern, str(err)):
            raise AssertionError(f"a different documented limit was hit: {err}") from err
        raise


def _require(condition: bool, op: str, message: str) -> None:
    if not condition:
        raise DocViolation(f"{op}: {message}")


def _unsupported_by_fake(op: str, what: str) -> NotImplementedError:
    return NotImplementedError(f"{op}: {what} is documented but not implemented by this fake")


@dataclass
class Call:
    op: str
    args: dict[str, Any] = field(default_factory=dict)


class FakeTorchNpu:
    """Module-like: `FakeTorchNpu().npu_rms_norm(...)` as `torch_npu.npu_rms_norm(...)`. Every call is recorded
    in `calls` (op name and arguments by name) so tests can inspect what the backend passed."""

    __name__ = "fake_torch_npu"

    def __init__(self, *, profile: str | None = None, allow_float32_attention: bool = False) -> None:
        if profile not in PROFILES:
            raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
        self.profile = profile
        self.allow_float32_attention = allow_float32_attention
        self.calls: list[Call] = []

    def calls_of(self, op: str) -> list[Call]:
        return [c for c in self.calls if c.op == op]

    def _record(self, op: str, args: dict[str, Any]) -> None:
        self.calls.append(Call(op, {k: v for k, v in args.items() if k != "self"}))

    # ------------------------------------------------------------------------------------------ dense ops

    def npu_rms_norm(self, input, gamma, epsilon=1e-06):
        """npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)

        [PTA] y = x / sqrt(mean(x^2) + eps) * gamma over gamma's dims (the last dims of x); the second
        output is rstd = 1 / Rms(x), float32, shape x.shape[:-gamma.dim()] + (1,) * gamma.dim() [META].
        gamma's dtype must equal self's; dtypes float16/bfloat16/float32; 1-8 dims.
        """
        op = "npu_rms_norm"
        self._record(op, locals())
        _require(input.dtype in FLOATS, op, f"self dtype {input.dtype} is not float16/bfloat16/float32")
        _require(gamma.dtype == input.dtype, op, f"gamma dtype {gamma.dtype} must equal self's {input.dtype}")
        _require(1 <= input.dim() <= 8, op, f"self must have 1-8 dims, got {input.dim()}")
        _require(
            gamma.dim() <= input.dim() and tuple(gamma.shape) == tuple(input.shape[input.dim() - gamma.dim() :]),
            op,
            f"gamma shape {tuple(gamma.shape)} must be the last dims of self {tuple(input.shape)}",
        )
        dims = tuple(range(input.dim() - gamma.dim(), input.dim()))
        x = input.float()
        rstd = torch.rsqrt(x.pow(2).mean(dim=dims, keepdim=True) + epsilon)
        return (x * rstd * gamma.float()).to(input.dtype), rstd

    def npu_rotary_mul(self, input, r1, r2, rotary_mode="half", rotate=None):
        """npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half', Tensor? rotate=None) -> Tensor

        [PTA] half:       x1, x2 = chunk(x, 2, -1); out = r1 * x + r2 * cat(-x2, x1)
              interleave: out = r1 * x + r2 * stack(-x[..., 1::2], x[..., ::2]) interleaved back
        x, r1, r2 are 4-D; D even; r1/r2 broadcast to x (BSND: 1S1D, BS1D, BSND). ASSUMPTION: r1/r2 must
        have x's dtype (the docs list the same dtypes for all three and do not mention mixing). `rotate` is
        not in the API doc: the fake rejects it.
        """
        op = "npu_rotary_mul"
        self._record(op, locals())
        if rotate is not None:
            raise _unsupported_by_fake(op, "rotate")
        _require(
            rotary_mode in ("half", "interleave"),
            op,
            f"rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}",
        )
        for name, t in (("self", input), ("r1", r1), ("r2", r2)):
            _require(t.dim() == 4, op, f"{name} must be 4-D, got shape {tuple(t.shape)}")
            _require(t.dtype in FLOATS, op, f"{name} dtype {t.dtype} is not float16/bfloat16/float32")
        _require(r1.dtype == r2.dtype == input.dtype, op, "r1, r2 and self must share a dtype (ASSUMPTION)")
        _require(r1.shape == r2.shape, op, f"r1 {tuple(r1.shape)} and r2 {tuple(r2.shape)} differ")
        d = input.shape[-1]
        _require(d % 2 == 0, op, f"D must be even, got {d}")
        _require(r1.shape[-1] == d, op, f"r1's D {r1.shape[-1]} differs from self's {d}")
        for i in range(3):
            _require(
                r1.shape[i] in (1, input.shape[i]),
                op,
                f"r1 {tuple(r1.shape)} does not broadcast to self {tuple(input.shape)}",
            )
        if self.profile is not None:
            _require(d < 896, op, f"D must be < 896, got {d}")
        x, c, s = input.float(), r1.float(), r2.float()
        if rotary_mode == "half":
            x1, x2 = x.chunk(2, dim=-1)
            rotated = torch.cat((-x2, x1), dim=-1)
        else:
            rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
        return (c * x + s * rotated).to(input.dtype)

    def npu_swiglu(self, input, dim=-1):
        """npu_swiglu(Tensor self, int dim=-1) -> Tensor

        [PTA] out = swish(A) * B = A * sigmoid(A) * B, A the first and B the second half of self along dim.
        self: 1-8 dims, float32/float16/bfloat16, dim size even, "不支持非连续的Tensor，不支持空Tensor".
        Computed in float32 and rounded once (ASSUMPTION: a fused kernel does not round silu(A) first).
        """
        op = "npu_swiglu"
        self._record(op, locals())
        _require(input.dtype in FLOATS, op, f"dtype {input.dtype} is not float16/bfloat16/float32")
        _require(1 <= input.dim() <= 8, op, f"self must have 1-8 dims, got {input.dim()}")
        _require(-input.dim() <= dim < input.dim(), op, f"dim {dim} out of range for {input.dim()} dims")
        _require(input.shape[dim] % 2 == 0, op, f"size {input.shape[dim]} along dim {dim} is odd")
        _require(input.numel() > 0, op, "empty tensors are not supported")
        _require(input.is_contiguous(), op, "non-contiguous tensors are not supported")
        a, b = input.float().chunk(2, dim=dim)
        return (F.silu(a) * b).to(input.dtype)

    # ------------------------------------------------------------------------------------------ MoE ops

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
            _require(
                bias.dim() == 1 and bias.shape[0] == experts, op, f"bias must be [{experts}], got {tuple(bias.shape)}"
            )
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
        _require(
            group_list.shape[0] == experts, op, f"group_list has {group_list.shape[0]} entries for {experts} groups"
        )
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

    # ------------------------------------------------------------------------------------------ KV cache

    def npu_scatter_nd_update_(self, input, indices, updates):
        """npu_scatter_nd_update_(Tensor(a!) self, Tensor indices, Tensor updates) -> Tensor(a!)

        [PTA] In place: self[indices[i]] = updates[i], where each row of indices (last dim a <= self.dim())
        indexes self's first a dims; updates.shape == indices.shape[:-1] + self.shape[a:]. indices int32 or
        int64, at least 2-D, never out of range; self and updates share a dtype; self 1-8 dims.
        ASSUMPTION: duplicate indices are rejected (the docs do not say which write wins).
        """
        op = "npu_scatter_nd_update_"
        self._record(op, locals())
        allowed = (torch.float32, torch.float16, torch.bfloat16, torch.bool, torch.int64, torch.int8)
        _require(input.dtype in allowed, op, f"self dtype {input.dtype} is not supported")
        _require(updates.dtype == input.dtype, op, f"updates dtype {updates.dtype} must equal self's {input.dtype}")
        _require(indices.dtype in (torch.int32, torch.int64), op, f"indices dtype {indices.dtype} must be int32/int64")
        _require(1 <= input.dim() <= 8, op, f"self must have 1-8 dims, got {input.dim()}")
        _require(indices.dim() >= 2, op, f"indices must be at least 2-D, got {tuple(indices.shape)}")
        depth = indices.shape[-1]
        _require(depth <= input.dim(), op, f"index depth {depth} exceeds self's {input.dim()} dims")
        expected = tuple(indices.shape[:-1]) + tuple(input.shape[depth:])
        _require(tuple(updates.shape) == expected, op, f"updates shape {tuple(updates.shape)} must be {expected}")
        flat = indices.reshape(-1, depth).long()
        for d in range(depth):
            _require(bool(((flat[:, d] >= 0) & (flat[:, d] < input.shape[d])).all()), op, "indices out of range")
        _require(len(set(map(tuple, flat.tolist()))) == flat.shape[0], op, "duplicate indices (ASSUMPTION: rejected)")
        input[tuple(flat.unbind(-1))] = updates.reshape(flat.shape[0], *input.shape[depth:])
        return input

    # ------------------------------------------------------------------------------------------ attention

    def npu_fused_infer_attention_score(
        self,
        query,
        key,
        value,
        *,
        pse_shift=None,
        atten_mask=None,
        actual_seq_lengths=None,
        actual_seq_lengths_kv=None,
        dequant_scale1=None,
        quant_scale1=None,
        dequant_scale2=None,
        quant_scale2=None,
        quant_offset2=None,
        antiquant_scale=None,
        antiquant_offset=None,
        key_antiquant_scale=None,
        key_antiquant_offset=None,
        value_antiquant_scale=None,
        value_antiquant_offset=None,
        block_table=None,
        query_padding_size=None,
        kv_padding_size=None,
        key_shared_prefix=None,
        value_shared_prefix=None,
        actual_shared_prefix_len=None,
        query_rope=None,
        key_rope=None,
        key_rope_antiquant_scale=None,
        num_heads=1,
        scale=1.0,
        pre_tokens=2147483647,
        next_tokens=2147483647,
        input_layout="BSH",
        num_key_value_heads=0,
        sparse_mode=0,
        inner_precise=0,
        block_size=0,
        antiquant_mode=0,
        key_antiquant_mode=0,
        value_antiquant_mode=0,
        softmax_lse_flag=False,
    ):
        """npu_fused_infer_attention_score(Tensor query, Tensor key, Tensor value, *, Tensor? pse_shift=None, Tensor? atten_mask=None, SymInt[]? actual_seq_lengths=None, SymInt[]? actual_seq_lengths_kv=None, Tensor? dequant_scale1=None, Tensor? quant_scale1=None, Tensor? dequant_scale2=None, Tensor? quant_scale2=None, Tensor? quant_offset2=None, Tensor? antiquant_scale=None, Tensor? antiquant_offset=None, Tensor? key_antiquant_scale=None, Tensor? key_antiquant_offset=None, Tensor? value_antiquant_scale=None, Tensor? value_antiquant_offset=None, Tensor? block_table=None, Tensor? query_padding_size=None, Tensor? kv_padding_size=None, Tensor? key_shared_prefix=None, Tensor? value_shared_prefix=None, SymInt[]? actual_shared_prefix_len=None, Tensor? query_rope=None, Tensor? key_rope=None, Tensor? key_rope_antiquant_scale=None, int num_heads=1, float scale=1.0, int pre_tokens=2147483647, int next_tokens=2147483647, str input_layout="BSH", int num_key_value_heads=0, int sparse_mode=0, int inner_precise=0, int block_size=0, int antiquant_mode=0, int key_antiquant_mode=0, int value_antiquant_mode=0, bool softmax_lse_flag=False) -> (Tensor, Tensor)

        Implemented: input_layout "TND" with PageAttention (block_table), no quantization, pse, padding or
        prefix. query [T, N, D]; key/value [num_blocks, block_size, KV_N * D] (BnBsH) with identical
        shapes ([PTA] "key、value中对应tensor的shape需要完全一致"), contiguous, query's dtype; batch b owns
        query rows actual_seq_lengths[b-1]:actual_seq_lengths[b] (cumulative, last == T [OPS V5]) and
        attends to its first actual_seq_lengths_kv[b] cache positions (per batch under PageAttention),
        found through block_table[b] (int32). MLA: query_rope [T, N, Dr] and key_rope [blocks, bs, KV_N * Dr]
        come together and add q_rope . k_rope to the scores. Head h reads KV head h // (N / KV_N).
        sparse_mode 0: no mask allowed, no causal masking; sparse_mode 3 (rightDownCausal): atten_mask
        must be the 2048 x 2048 (or 1x / 1x1x) bool/int8/uint8 mask with 1 = masked ([OPS V5]), i.e.
        triu(ones, 1) (ASSUMPTION: the fake requires exactly that matrix); query i of Q attends to
        positions <= kv_len - Q + i. ASSUMPTION: sparse_mode 3 with kv_len < q_len is rejected (rows
        would see nothing). Returns (attention_out [T, N, D_v] in query's dtype, softmax_lse [T, N, 1]
        float32 when softmax_lse_flag else a [1] zero tensor).
        Block ids past a batch's last needed block are not read (the -1 padding is fine); the op itself
        does not validate block ids ([PTA] "不会对blockid的合法性进行校验"), the fake does.
        """
        op = "npu_fused_infer_attention_score"
        self._record(op, locals())
        unsupported = dict(
            pse_shift=pse_shift, dequant_scale1=dequant_scale1, quant_scale1=quant_scale1,
            dequant_scale2=dequant_scale2, quant_scale2=quant_scale2, quant_offset2=quant_offset2,
            antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset,
            key_antiquant_scale=key_antiquant_scale, key_antiquant_offset=key_antiquant_offset,
            value_antiquant_scale=value_antiquant_scale, value_antiquant_offset=value_antiquant_offset,
            query_padding_size=query_padding_size, kv_padding_size=kv_padding_size,
            key_shared_prefix=key_shared_prefix, value_shared_prefix=value_shared_prefix,
            actual_shared_prefix_len=actual_shared_prefix_len, key_rope_antiquant_scale=key_rope_antiquant_scale,
        )  # fmt: skip
        for name, v in unsupported.items():
            if v is not None:
                raise _unsupported_by_fake(op, name)
        if antiquant_mode or key_antiquant_mode or value_antiquant_mode:
            raise _unsupported_by_fake(op, "antiquant modes")
        if input_layout != "TND":
            raise _unsupported_by_fake(op, f"input_layout {input_layout!r} (only TND is)")
        if block_table is None:
            raise _unsupported_by_fake(op, "TND without PageAttention")
        _require(inner_precise in (0, 1, 2, 3), op, f"inner_precise must be 0-3, got {inner_precise}")

        # dtypes and contiguity ("不支持非连续的Tensor" for query, key, value, query_rope, key_rope)
        allowed = FLOATS if self.allow_float32_attention and self.profile is None else HALVES
        _require(query.dtype in allowed, op, f"query dtype {query.dtype} is not float16/bfloat16")
        for name, t in (("key", key), ("value", value)):
            _require(t.dtype == query.dtype, op, f"{name} dtype {t.dtype} differs from query's {query.dtype}")
        _require((query_rope is None) == (key_rope is None), op, "query_rope and key_rope go together")
        tensors = {"query": query, "key": key, "value": value, "query_rope": query_rope, "key_rope": key_rope}
        for name, t in tensors.items():
            if t is not None:
                _require(t.is_contiguous(), op, f"{name} must be contiguous")
        if query_rope is not None:
            _require(
                query_rope.dtype == query.dtype and key_rope.dtype == key.dtype, op, "rope dtypes must match query/key"
            )

        # shapes
        _require(query.dim() == 3, op, f"TND query must be 3-D, got {tuple(query.shape)}")
        tokens, heads, head_dim = query.shape
        _require(num_heads == heads, op, f"num_heads {num_heads} differs from query's N {heads}")
        kv_heads = num_key_value_heads or num_heads
        _require(heads % kv_heads == 0, op, f"num_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        _require(heads // kv_heads <= 64 or self.profile == "ascend950", op, "num_heads / num_key_value_heads > 64")
        if key.dim() == 4:
            raise _unsupported_by_fake(op, "the (blocknum, KV_N, blocksize, D) cache layout")
        _require(key.dim() == 3, op, f"paged key must be [blocknum, blocksize, H], got {tuple(key.shape)}")
        _require(key.shape == value.shape, op, f"key {tuple(key.shape)} and value {tuple(value.shape)} shapes differ")
        num_blocks, page, kv_width = key.shape
        _require(block_size > 0 and block_size == page, op, f"block_size {block_size} differs from key's {page}")
        _require(
            kv_width == kv_heads * head_dim, op, f"key H {kv_width} != num_key_value_heads {kv_heads} x D {head_dim}"
        )
        value_dim = value.shape[2] // kv_heads
        rope_dim = 0
        if query_rope is not None:
            rope_dim = query_rope.shape[-1]
            _require(query_rope.shape == (tokens, heads, rope_dim), op, f"query_rope must be [{tokens}, {heads}, Dr]")
            _require(
                key_rope.shape == (num_blocks, page, kv_heads * rope_dim),
                op,
                "key_rope must be [blocknum, blocksize, KV_N * Dr]",
            )

        # lengths and the block table
        _require(actual_seq_lengths is not None, op, "TND needs actual_seq_lengths")
        _require(actual_seq_lengths_kv is not None, op, "PageAttention needs actual_seq_lengths_kv")
        ends = [int(v) for v in actual_seq_lengths]
        kv_lens = [int(v) for v in actual_seq_lengths_kv]
        batch = len(ends)
        _require(batch > 0 and len(kv_lens) == batch, op, f"{batch} query lengths but {len(kv_lens)} kv lengths")
        _require(
            all(v >= 0 for v in ends) and ends == sorted(ends), op, f"actual_seq_lengths {ends} must be non-decreasing"
        )
        _require(ends[-1] == tokens, op, f"the last actual_seq_lengths {ends[-1]} must equal T = {tokens}")
        q_lens = [b - a for a, b in zip([0] + ends[:-1], ends)]
        _require(block_table.dtype == torch.int32, op, f"block_table must be int32, got {block_table.dtype}")
        _require(
            block_table.dim() == 2 and block_table.shape[0] == batch, op, f"block_table must be [{batch}, max_blocks]"
        )
        needed = [-(-n // page) for n in kv_lens]
        _require(all(n >= 0 for n in kv_lens), op, "negative kv length")
        _require(
            block_table.shape[1] >= max(needed), op, "block_table has fewer columns than the longest context needs"
        )
        _require(num_blocks >= sum(needed), op, "fewer cache blocks than the contexts need")

        # masks
        if sparse_mode == 0:
            _require(atten_mask is None, op, "TND supports sparse_mode 0 only without atten_mask")
        elif sparse_mode == 3:
            _require(atten_mask is not None, op, "sparse_mode 3 needs the 2048 x 2048 atten_mask")
            _require(
                atten_mask.dtype in (torch.bool, torch.int8, torch.uint8), op, "atten_mask must be bool/int8/uint8"
            )
            _require(
                tuple(atten_mask.shape) in ((MASK_SIZE,) * 2, (1,) + (MASK_SIZE,) * 2, (1, 1) + (MASK_SIZE,) * 2),
                op,
                f"sparse_mode 3 takes a (1, 1,) 2048 x 2048 mask, got {tuple(atten_mask.shape)}",
            )
            expected = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=atten_mask.device), 1)
            _require(
                torch.equal(atten_mask.reshape(MASK_SIZE, MASK_SIZE).bool(), expected),
                op,
                "the mask must be triu(ones, 1)",
            )
            for b in range(batch):
                _require(
                    kv_lens[b] >= q_lens[b],
                    op,
                    f"batch {b}: kv length {kv_lens[b]} < query length {q_lens[b]} (ASSUMPTION)",
                )
        elif sparse_mode in (1, 2, 4):
            raise DocViolation(f"{op}: TND supports sparse_mode 0 (no mask) or 3 (with mask), got {sparse_mode}")
        else:
            raise DocViolation(f"{op}: sparse_mode {sparse_mode} is not supported")

        if self.profile is not None:
            self._fia_profile_limits(
                op,
                head_dim,
                value_dim,
                rope_dim,
                heads,
                kv_heads,
                q_lens,
                page,
                sparse_mode,
                softmax_lse_flag,
                query.dtype,
            )

        # the computation
        group = heads // kv_heads
        out = torch.zeros(tokens, heads, value_dim, dtype=torch.float32)
        lse = torch.zeros(tokens, heads, 1, dtype=torch.float32)
        k_rows = key.view(num_blocks * page, kv_heads, head_dim)
        v_rows = value.view(num_blocks * page, kv_heads, value_dim)
        kr_rows = None if key_rope is None else key_rope.view(num_blocks * page, kv_heads, rope_dim)
        start = 0
        for b in range(batch):
            q_len, kv_len = q_lens[b], kv_lens[b]
            if q_len == 0:
                continue
            blocks = block_table[b, : needed[b]].long()
            _require(
                bool(((blocks >= 0) & (blocks < num_blocks)).all()),
                op,
                f"batch {b}: block ids {blocks.tolist()} out of range",
            )
            slots = (blocks[:, None] * page + torch.arange(page)).reshape(-1)[:kv_len]
            keys = k_rows[slots].float().repeat_interleave(group, dim=1)  # [S, N, D]
            values = v_rows[slots].float().repeat_interleave(group, dim=1)
            q = query[start : start + q_len].float()
            scores = torch.einsum("qnd,snd->nqs", q, keys)
            if kr_rows is not None:
                key_pe = kr_rows[slots].float().repeat_interleave(group, dim=1)
                scores = scores + torch.einsum("qnd,snd->nqs", query_rope[start : start + q_len].float(), key_pe)
            scores = scores * scale
            if sparse_mode == 3:
                last_visible = kv_len - q_len + torch.arange(q_len)  # right-down aligned
                scores = scores.masked_fill(torch.arange(kv_len)[None, :] > last_visible[:, None], float("-inf"))
            out[start : start + q_len] = torch.einsum("nqs,snd->qnd", scores.softmax(dim=-1), values)
            lse[start : start + q_len] = scores.logsumexp(dim=-1).transpose(0, 1)[..., None]
            start += q_len
        softmax_lse = lse if softmax_lse_flag else torch.zeros(1, dtype=torch.float32)
        return out.to(query.dtype), softmax_lse

    def _fia_profile_limits(self, op, d, dv, dr, heads, kv_heads, q_lens, page, sparse_mode, lse_flag, dtype):
        max_q = max(q_lens)
        if self.profile == "ascend950":  # [OPS] aclnnFusedInferAttentionScoreV5.md
            _require(d <= 512, op, f"D must be <= 512, got {d}")
            if dr:
                _require(dr == 64, op, f"query_rope/key_rope D must be 64, got {dr}")
                _require(d in (128, 512), op, f"with rope, query D must be 128 or 512, got {d}")
                if d == 512:  # "Decode MLA"
                    _require(kv_heads == 1, op, "Decode MLA needs num_key_value_heads 1")
                    _require(sparse_mode in (0, 3, 4), op, f"Decode MLA supports sparse_mode 0/3/4, got {sparse_mode}")
                _require(
                    page % 16 == 0 and page <= 1024, op, f"MLA block_size must be 16-aligned and <= 1024, got {page}"
                )
            elif d in (64, 128) and dv in (64, 128):
                _require(page % 16 == 0 and page <= 1024, op, f"block_size must be 16-aligned and <= 1024, got {page}")
            elif max_q > 1:
                _require(
                    page % 128 == 0 and page <= 1024, op, f"block_size must be 128-aligned and <= 1024, got {page}"
                )
            else:
                _require(page % 16 == 0 and page <= 512, op, f"block_size must be 16-aligned and <= 512, got {page}")
            _require(kv_heads * d <= 65535, op, "BnBsH caches with KV_N * D > 65535 are rejected")
            return
        # "atlas_a2_a3": [PTA] torch_npu-npu_fused_infer_attention_score.md (the v1 API's own doc)
        _require(len(q_lens) <= 65536, op, "B must be <= 65536")
        if dr:
            _require(d in (128, 512), op, f"with query_rope, query D must be 512 or 128, got {d}")
            _require(d == 512, op, "TND with query D 128 and rope does not support PageAttention")
            _require(heads in (32, 64, 128), op, f"MLA (D 512) needs num_heads 32/64/128, got {heads}")
            _require(kv_heads == 1 and dr == 64, op, "MLA (D 512) needs num_key_value_heads 1 and rope D 64")
            _require(all(q <= 16 for q in q_lens), op, f"MLA (D 512) takes 1-16 query tokens per batch, got {max_q}")
            _require(page in (16, 128), op, f"MLA (D 512) block_size must be 16 or 128, got {page}")
            _require(not lse_flag, op, "MLA (D 512) does not output softmax_lse")
            if max_q == 1:
                _require(sparse_mode == 0, op, "MLA (D 512) with Q_S 1 supports only sparse_mode 0 without a mask")
            else:
                _require(sparse_mode == 3, op, "MLA (D 512) with Q_S > 1 supports only sparse_mode 3 with the mask")
        else:
            _require(d != 512, op, "TND with query D 512 needs query_rope and key_rope")
            _require(False, op, "TND without rope (D != 512) does not support PageAttention")
        _require(dtype in HALVES, op, "float16/bfloat16 only")

    # ------------------------------------------------------------------------------------------ MC2

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

    @staticmethod
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
        self._mc2_common(op, bs, h, k, ep_world_size, ep_rank_id, moe_expert_num, group_ep, shared_expert_rank_num)
        self._check_expert_ids(op, expert_ids, bs, moe_expert_num)
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
        self._mc2_common(op, bs, h, k, ep_world_size, ep_rank_id, moe_expert_num, group_ep, shared_expert_rank_num)
        self._check_expert_ids(op, expert_ids, bs, moe_expert_num)
        _require(
            expand_x.shape[0] >= bs * k, op, f"expand_x has {expand_x.shape[0]} rows, fewer than BS * K = {bs * k}"
        )
        _require(
            expand_idx.dtype == torch.int32 and expand_idx.shape == (bs * k,),
            op,
            f"expand_idx must be [{bs * k}] int32",
        )
        _require(
            ep_send_counts.dtype == torch.int32 and ep_send_counts.dim() == 1, op, "ep_send_counts must be 1-D int32"
        )
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
