"""The op contract: what model code calls on a backend, with exact semantics and shapes.

Model code is written once against `Ops` and `AttentionOps`; the reference backend's implementation is
the executable definition of each op. Shapes: T = tokens in the step, H = query heads, D = hidden size.

For every op: inputs may be non-contiguous views (the model passes slices); outputs are in the input's
dtype (the router calls `linear` in float32 while the rest of the model runs in bfloat16); reductions
accumulate in float32. Where the reference rounds an intermediate to the input dtype, a backend
should too, or its bfloat16 results drift beyond the suite's tolerance: `silu_and_mul` rounds
silu(gate) before the product, and `expert_ffn` rounds the gate/up GEMM output and the activation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch

from deepinfer_core.backend._deepseek_ops import (  # the DeepSeek-V4/V4.1-only ops, re-exported here
    BLOCK_FORMATS,
    DSPARK_OPS,
    V4_OPS,
    V41_OPS,
    V4AttentionOps,
    V4Ops,
    V41AttentionOps,
    V41Ops,
    block_length,
    check_layer_fn,
)
from deepinfer_core.backend.weight_formats import MXFP4, BlockFP8  # the quantized weight formats, re-exported
from deepinfer_core.kv.layout import CacheSpec

__all__ = [
    "AttentionMetadata",
    "AttentionOps",
    "BLOCK_FORMATS",
    "block_length",
    "check_layer_fn",
    "BlockFP8",
    "MXFP4",
    "Ops",
    "RoutingConfig",
    "OP_NAMES",
    "DSPARK_OPS",
    "V4_OPS",
    "V41_OPS",
    "V4AttentionOps",
    "V4Ops",
    "V41AttentionOps",
    "V41Ops",
]

# Every op a backend may be asked about in `Capabilities.supports`.
OP_NAMES = (
    "rms_norm",
    "rotary",
    "linear",
    "head_linear",
    "silu_and_mul",
    "moe_route",
    "expert_ffn",
    "paged_attention",
    *V4_OPS,
    *V41_OPS,
    *DSPARK_OPS,
)


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """How a MoE layer picks experts (DeepSeek V2/V3/V4 routing).

    method:
      "greedy"               top-k over all experts' scores;
      "group_limited_greedy" (V2) keep `topk_groups` of `num_groups` groups ranked by their max score;
      "noaux_tc"             (V3) rank groups by the sum of their two best bias-corrected scores, and
                             choose experts by bias-corrected score but weight them by the raw score;
      "hash"                 (V4's first layers) the experts are given (a fixed token id -> experts
                             table); only their weights come from the scores.
    scoring: softmax, sigmoid, or (V4) sqrtsoftplus = sqrt(softplus(logit)).
    """

    num_experts: int
    top_k: int
    method: Literal["greedy", "group_limited_greedy", "noaux_tc", "hash"] = "greedy"
    scoring: Literal["softmax", "sigmoid", "sqrtsoftplus"] = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    normalize: bool = False  # divide the chosen weights by their sum
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in 1..num_experts ({self.num_experts}), got {self.top_k}")
        if self.num_experts % self.num_groups:
            raise ValueError(f"num_experts {self.num_experts} is not divisible by num_groups {self.num_groups}")
        if not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"topk_groups must be in 1..num_groups ({self.num_groups}), got {self.topk_groups}")
        per_group = self.num_experts // self.num_groups
        if self.method != "greedy" and self.top_k > self.topk_groups * per_group:
            raise ValueError(
                f"top_k {self.top_k} exceeds the {self.topk_groups * per_group} experts left in "
                f"{self.topk_groups} kept group(s) of {per_group}; raise topk_groups or lower top_k"
            )
        if self.method == "noaux_tc" and per_group < 2:
            raise ValueError(f"noaux_tc ranks groups by their two best experts; groups of {per_group} are too small")


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where each sequence of a ragged step sits in the paged cache.

    Sequence b owns queries `query_start_loc[b]:query_start_loc[b+1]`; those are its last q_len tokens
    out of `seq_lens[b]` context tokens (already written to the cache), so query i has absolute position
    `seq_lens[b] - q_len + i` and attends causally to positions 0..that position.
    """

    query_start_loc: torch.Tensor  # [B + 1] int64, cumulative query lengths, starts at 0
    seq_lens: torch.Tensor  # [B] int64, context length including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int64 block ids, -1 where unused
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each of this step's tokens
    # Per-sequence caches (SLIDING_WINDOW rings, SEQUENCE_STATE), for models that have them (V4):
    seq_slots: torch.Tensor | None = None  # [B] int64, the sequence's slot in those caches
    # [B] int64: the first position whose ring/state entries this sequence wrote since it was admitted;
    # ring entries of earlier positions are stale (another sequence's, or never written)
    window_starts: torch.Tensor | None = None
    # [B] int64: positions below are in prefix-cache blocks shared with other sequences; a sequence
    # that recomputes them (V4's bounded replay) must not write those blocks
    cached_lens: torch.Tensor | None = None
    # [B] int64: the first position whose final hidden state this step or a later one needs (its logits);
    # a model may skip work no needed position depends on. None: every position is needed
    needed_from: torch.Tensor | None = None
    # the most queries any sequence has in this step, when the caller knows it on the host (vLLM's
    # max_query_len); 1 marks a decode step, which a model may plan on the device without host reads
    max_query_len: int | None = None
    # every sequence has exactly max_query_len queries (vLLM's uniform_decode): its newest tokens, all past
    # its cached prefix and its window_start (a decode step, or a verify step of its last token and drafts,
    # padded to the step's most), so a model may plan it on the device too
    uniform_decode: bool = False

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


@runtime_checkable
class Ops(Protocol):
    """Dense and MoE compute ops. All take and return tensors on the backend's device."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [T, D] -> x / sqrt(mean(x^2) + eps) * weight, accumulated in float32, returned in x.dtype."""
        ...

    def rotary(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool
    ) -> torch.Tensor:
        """Rotate x [T, H, R] by the angles of `positions` [T]; cos/sin [max_pos, R/2] (scaling folded in).

        interleaved=True rotates pairs (2i, 2i+1) and keeps that order (DeepSeek's rope layout);
        False rotates pairs (i, i + R/2) (the "rotate half" layout).
        """
        ...

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] @ weight[N, K]^T (+ bias [N]) -> [..., N] in x.dtype."""
        ...

    def head_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Per-head linear map: x [T, H, K], weight [H, N, K] -> [T, H, N] (MLA's weight absorption)."""
        ...

    def silu_and_mul(self, x: torch.Tensor, *, limit: float | None = None) -> torch.Tensor:
        """x [T, 2I] = [gate | up] -> silu(gate) * up [T, I].

        limit (V4's swiglu_limit, op feature "swiglu_limit"): silu(min(gate, limit)) * clamp(up, -limit, limit).
        """
        ...

    def moe_route(
        self,
        router_logits: torch.Tensor,
        config: RoutingConfig,
        correction_bias: torch.Tensor | None = None,
        *,
        expert_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits [T, E] -> (weights [T, top_k] float32, expert ids [T, top_k] int64), per `config`.

        `correction_bias` [E], when given, is added to the scores for choosing (any method) but not to
        the weights; normalize divides by (sum + 1e-20). The order of the k experts is free (the
        conformance suite compares the chosen set per token). method "hash" (op feature "hash_routing")
        takes the experts from `expert_ids` [T, top_k] and returns them.

        Ties: equal choosing scores go to the lower expert id, and equal group scores to the lower group
        (a stable sort, descending), so the choice is the same on every backend.
        """
        ...

    def expert_ffn(
        self,
        x: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        *,
        swiglu_limit: float | None = None,
        row_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Grouped expert MLP. x [N, D] rows sorted by expert, tokens_per_expert [E] (sums to N),
        w13 [E, 2I, D] (gate rows then up rows), w2 [E, D, I] -> [N, D] = w2_e(silu(gate) * up), the
        activation clamped as `silu_and_mul(limit=swiglu_limit)` does.

        row_scales [N] float32 (op feature "expert_row_scales"): each row's activation is computed in float32
        from the x.dtype projections (the clamp against swiglu_limit itself, in float32; nothing rounded in
        between), as (silu(gate) * up) * scale, and only then rounded to x.dtype for w2 — where DeepSeek-V4.1
        applies the routing weight (its combine then sums with weight 1). A row of scale 0 gives zeros."""
        ...


@runtime_checkable
class AttentionOps(Protocol):
    """Attention over the backend's own paged cache layout."""

    def paged_attention(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        spec: CacheSpec,
        meta: AttentionMetadata,
        *,
        scale: float,
        value_dim: int,
        value_offset: int = 0,
    ) -> torch.Tensor:
        """Causal attention of q [T, H, Dk] over cached entries [*, Hkv, Dc] (H % Hkv == 0).

        Keys are entries[..., :Dk]; values are entries[..., value_offset : value_offset + value_dim].
        MLA in weight-absorbed form caches one latent entry (kv_lora_rank + rope dims) with
        value_offset 0; standard attention caches K|V side by side. Returns [T, H, value_dim] in q.dtype.
        """
        ...
