"""The ascend950 op table: torch_npu's fused ops where one exists, aten (which torch_npu runs on the NPU)
for the plain GEMMs. The torch_npu module is passed in, so the glue can be tested on CPU against an
implementation written from torch_npu's documentation (tests/backends/ascend/fake_torch_npu.py).

Imports torch and core only; torch_npu arrives as the `npu` argument, imported by the plugin's hooks.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from deepinfer_core.backend.ops import RoutingConfig

__all__ = ["AscendOps", "expand_rotary_tables"]


def expand_rotary_tables(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, interleaved: bool):
    """cos/sin [max_pos, R/2] -> the full-width [1, T, 1, R] tables npu_rotary_mul multiplies by:
    each angle twice, side by side for "interleave" (pairs 2i, 2i+1), in halves for "half"."""
    c, s = cos[positions], sin[positions]  # [T, R/2]
    if interleaved:
        c, s = c.repeat_interleave(2, dim=-1), s.repeat_interleave(2, dim=-1)
    else:
        c, s = torch.cat([c, c], dim=-1), torch.cat([s, s], dim=-1)
    return c[None, :, None, :], s[None, :, None, :]


class AscendOps:
    """Implements deepinfer_core.backend.ops.Ops with torch_npu (`npu`)."""

    def __init__(self, npu: ModuleType) -> None:
        self.npu = npu
        self._tables: tuple = ()  # (positions, cos, sin, interleaved, dtype, tables) of the last rotary call

    def _rotary_tables(self, positions, cos, sin, interleaved: bool, dtype: torch.dtype):
        """The expanded tables, built once per step: every layer's q and k rotate by the same positions."""
        last = self._tables
        same = last and last[0] is positions and last[1] is cos and last[2] is sin
        if not (same and last[3:5] == (interleaved, dtype)):
            tables = expand_rotary_tables(cos.to(dtype), sin.to(dtype), positions, interleaved)
            self._tables = last = (positions, cos, sin, interleaved, dtype, tables)
        return last[5]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, _rstd = self.npu.npu_rms_norm(x, weight, epsilon=eps)
        return y

    def rotary(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool
    ) -> torch.Tensor:
        """x [T, H, R] as BSND [1, T, H, R] through npu_rotary_mul, which keeps the element order."""
        c, s = self._rotary_tables(positions, cos, sin, interleaved, x.dtype)
        mode = "interleave" if interleaved else "half"
        return self.npu.npu_rotary_mul(x[None], c, s, mode)[0]

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def head_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [T, H, K], weight [H, N, K] -> [T, H, N]: one batched GEMM over heads."""
        return torch.bmm(x.transpose(0, 1), weight.transpose(1, 2)).transpose(0, 1)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.npu.npu_swiglu(x.contiguous(), dim=-1)  # silu(first half) * second half; no views taken

    def moe_route(
        self, router_logits: torch.Tensor, config: RoutingConfig, correction_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts chosen by npu_moe_gating_top_k; their weights gathered from the raw scores here, so the
        contract's rule (weigh by the score without the bias, normalise, scale) does not depend on the
        op's output-weight options."""
        logits = router_logits.float()
        grouped = config.method != "greedy" and config.num_groups > 1
        _y, expert_idx, _norm = self.npu.npu_moe_gating_top_k(
            logits,
            config.top_k,
            bias=None if correction_bias is None else correction_bias.float(),
            k_group=config.topk_groups if grouped else 1,
            group_count=config.num_groups if grouped else 1,
            group_select_mode=1 if config.method == "noaux_tc" else 0,  # 1: a group's two best; 0: its best
            renorm=0,
            norm_type=1 if config.scoring == "sigmoid" else 0,  # 1: sigmoid, 0: softmax
            out_flag=False,
            routed_scaling_factor=1.0,
            eps=1e-20,
        )
        ids = expert_idx.long()  # [T, K]
        scores = logits.sigmoid() if config.scoring == "sigmoid" else logits.softmax(dim=-1)
        weights = scores.gather(1, ids)
        if config.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * config.routed_scaling_factor, ids

    def expert_ffn(
        self,
        x: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        *,
        row_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Two npu_grouped_matmul calls (one launch for all experts each) around npu_swiglu. The weights are
        [E, N, K]; the op multiplies x [rows, K] by [E, K, N], so it gets transposed views. row_scales
        (DeepSeek-V4.1's "expert_row_scales") is declared unsupported and refused."""
        if row_scales is not None:
            raise NotImplementedError(
                "ascend950's expert_ffn does not take row_scales (op feature 'expert_row_scales', declared "
                "unsupported in its capabilities): apply the routing weights in the combine, or run DeepSeek-V4.1 "
                "on a backend that supports expert_row_scales (e.g. cpu)"
            )
        if x.shape[0] == 0:
            return torch.empty_like(x)
        # group_list_type 0: the running sum of the counts (type 1, plain counts, may not have length 1)
        ends = tokens_per_expert.to(device=x.device, dtype=torch.int64).cumsum(0)
        common = dict(group_list=ends, split_item=3, group_type=0, group_list_type=0)
        [gate_up] = self.npu.npu_grouped_matmul([x], [w13.transpose(1, 2)], **common)  # [rows, 2I]
        act = self.npu.npu_swiglu(gate_up, dim=-1)  # [rows, I]
        [out] = self.npu.npu_grouped_matmul([act], [w2.transpose(1, 2)], **common)  # [rows, D]
        return out
