"""The op table and attention of the nvidia_sm100 backend: Triton kernels, cuBLAS (through torch) for
dense GEMMs in the default mode, the fixed-tiling Triton GEMM in batch-invariant mode and for quantized weights
(ops.BlockFP8, ops.MXFP4: each tile is dequantized in registers with its scales, never in memory; kernels.quant).

DeepSeek-V4's op features on those fast paths are Triton too: the swiglu limit (`silu_and_mul(limit=)`,
`expert_ffn(swiglu_limit=)`, fused into the same kernels) and sqrtsoftplus / hash routing (the routing
kernel); hc_pre (a row-local rms kernel, the mixing GEMM by `linear`, then the weights, Sinkhorn and the
collapse in one kernel), hc_post and softmax_pool are kernels (kernels.hyper), and so is V4's sparse_attention
(kernels.sparse_attention: one program per query token, no host reads, rows independent of the batch).
So is the lightning indexer, V4's indexer_topk and V4.1's indexer_select (kernels.indexer: a scores kernel,
then the top-k by torch ops on the device, no host reads). V4.1's other ops are kernels as well: hc_mixes,
hc_collapse and hc_expand (kernels.hyper, hc_pre's kernels with V4.1's roundings), round_to_format
(kernels.rounding, bitwise the reference's), engram_gate (kernels.engram), and the op feature
expert_row_scales (`expert_ffn(row_scales=)`), fused into the grouped expert GEMM's epilogue. V4.1's DSpark
draft attention, block_attention, is torch ops on the device (kernels.block_attention, no host reads).

Imported only after the backend is selected (it imports triton).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer_core.backend.ops import MXFP4, AttentionMetadata, BlockFP8, RoutingConfig, check_layer_fn
from deepinfer_core.kv.formats import BlockFormat
from deepinfer_core.kv.layout import CacheSpec, KVLayout
from deepinfer_nvidia_sm100.kernels import (
    attention,
    block_attention,
    elementwise,
    engram,
    gemm,
    hyper,
    indexer,
    moe,
    rounding,
    routing,
    sparse_attention,
)

__all__ = ["NvidiaAttention", "NvidiaOps"]

Weight = torch.Tensor | BlockFP8 | MXFP4  # a dense weight, or DeepSeek's FP8 / FP4 formats


class NvidiaOps:
    """Implements deepinfer_core.backend.ops.Ops, V4Ops and V41Ops on one GPU.

    batch_invariant: every op's result for a row must not depend on the other rows of the call. The
    row-local kernels (V4's and V4.1's among them) and the grouped expert GEMM are so always; `linear` and
    `head_linear` then use the fixed-tiling Triton GEMM instead of cuBLAS, whose algorithm changes with the
    number of rows (hc_pre's and hc_mixes' mixing GEMM is a `linear`).
    """

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return elementwise.rms_norm(x, weight, eps)

    def rotary(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool
    ) -> torch.Tensor:
        return elementwise.rotary(x, positions, cos, sin, interleaved=interleaved)

    def linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.batch_invariant or isinstance(weight, (BlockFP8, MXFP4)):  # dequantized in the Triton GEMM
            return gemm.matmul(x, weight, bias, fixed_tiles=self.batch_invariant)
        return F.linear(x, weight, bias)

    def head_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [T, H, K], weight [H, N, K] -> [T, H, N]."""
        if self.batch_invariant:
            return gemm.batched_matmul(x.transpose(0, 1), weight).transpose(0, 1)
        return torch.bmm(x.transpose(0, 1), weight.transpose(1, 2)).transpose(0, 1)

    def silu_and_mul(self, x: torch.Tensor, *, limit: float | None = None) -> torch.Tensor:
        return elementwise.silu_and_mul(x, limit)

    def moe_route(
        self,
        router_logits: torch.Tensor,
        config: RoutingConfig,
        correction_bias: torch.Tensor | None = None,
        *,
        expert_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return routing.moe_route(router_logits, config, correction_bias, expert_ids)

    def expert_ffn(
        self,
        x: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        w13: Weight,
        w2: Weight,
        *,
        swiglu_limit: float | None = None,
        row_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The grouped Triton GEMMs; row_scales (V4.1's routing weights) applied in the activation epilogue."""
        return moe.expert_ffn(
            x, tokens_per_expert, w13, w2,
            fixed_tiles=self.batch_invariant, swiglu_limit=swiglu_limit, row_scales=row_scales,
        )  # fmt: skip

    # DeepSeek-V4's hyper-connections and the compressors' pooling

    def hc_pre(
        self,
        streams: torch.Tensor,
        fn: torch.Tensor,
        scale: torch.Tensor,
        base: torch.Tensor,
        *,
        sinkhorn_iters: int,
        eps: float,
        norm_eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The mixes (see _mixes), then one kernel for the rest: pre / post, the comb matrix and its Sinkhorn
        iterations, the collapse of the streams."""
        mixes = self._mixes(streams, fn, norm_eps)
        return hyper.hc_mix(streams, mixes, scale, base, sinkhorn_iters, eps)

    def _mixes(self, streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
        """[T, rows of fn] float32: as the reference, normalise (a row-local kernel), then multiply by `linear`."""
        return self.linear(hyper.hc_norm(streams, norm_eps), fn.float())  # [T, N * D] @ [rows, N * D]^T

    def hc_post(
        self, block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        return hyper.hc_post(block_out, streams, post, comb)

    def softmax_pool(self, values: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return hyper.softmax_pool(values, logits)

    # DeepSeek-V4.1's ops: hc_pre's kernels with V4.1's roundings, the block rounding, the engram gate

    def hc_mixes(
        self,
        streams: torch.Tensor,
        fn: torch.Tensor,
        scale: torch.Tensor,
        base: torch.Tensor,
        *,
        sinkhorn_iters: int,
        eps: float,
        norm_eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hc_pre's kernels, storing pre in place of the collapse."""
        check_layer_fn(streams, fn)
        mixes = self._mixes(streams, fn, norm_eps)
        return hyper.hc_mix(streams, mixes, scale, base, sinkhorn_iters, eps, collapse=False)

    def hc_collapse(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return hyper.hc_collapse(streams, pre)

    def hc_expand(
        self, block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        return hyper.hc_post(block_out, streams, post, comb, round_terms=False)

    def round_to_format(self, x: torch.Tensor, fmt: str) -> torch.Tensor:
        return rounding.round_to_format(x, fmt)

    def engram_gate(
        self,
        streams: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        weight: torch.Tensor,
        dead: torch.Tensor,
        *,
        eps: float,
    ) -> torch.Tensor:
        return engram.engram_gate(streams, key, value, weight, dead, eps)


class NvidiaAttention:
    """Implements AttentionOps, V4AttentionOps and V41AttentionOps by Triton kernels over the row-per-slot caches of
    a layout with one row per slot (`KVLayout.slot_is_row`: `PackedKVLayout`'s paged, compressed paged and
    sliding-window rings, DeepSeek-V4.1's KV in FP8 / FP4 among them), with no host reads.

    sparse_attention, block_attention, indexer_topk and indexer_select read q and caches of one float32 / bfloat16 /
    float16 dtype, or caches packed in their spec's stored_format, one cached head; anything else is refused with a
    ValueError that says what was passed (nothing falls back to the reference's PyTorch code).
    """

    def __init__(self, layout: KVLayout, batch_invariant: bool = False) -> None:
        self.layout = layout
        self.block_size = layout.block_size
        # packed rows that queries may read staged or decoded in the kernels (kernels.packed): the two can round
        # differently on a GPU, so the batch-invariant mode decides by the caches' specs alone (decoded in the
        # kernels), never by the step's shapes
        self.stage = False if batch_invariant else None
        self.batch_invariant = batch_invariant

    def paged_attention(self, q, cache, spec, meta, *, scale: float, value_dim: int, value_offset: int = 0):
        return attention.paged_attention(
            q, cache, spec, meta, self.block_size, scale=scale, value_dim=value_dim, value_offset=value_offset
        )

    def sparse_attention(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        ring: torch.Tensor,
        ring_spec: CacheSpec,
        meta: AttentionMetadata,
        *,
        sinks: torch.Tensor,
        scale: float,
        compressed: torch.Tensor | None = None,
        compressed_spec: CacheSpec | None = None,
        indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """kernels.sparse_attention."""
        caches = [("kv", kv, None), ("ring", ring, ring_spec)]
        caches += [] if compressed is None else [("compressed", compressed, compressed_spec)]
        self._check_reads("sparse_attention", q, caches)
        return sparse_attention.sparse_attention(
            q, kv, ring, ring_spec, meta, self.block_size, sinks=sinks, scale=scale,
            compressed=compressed, compressed_spec=compressed_spec, indices=indices, stage=self.stage,
        )  # fmt: skip

    def block_attention(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        ring: torch.Tensor,
        ring_spec: CacheSpec,
        meta: AttentionMetadata,
        *,
        sinks: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """kernels.block_attention (a packed ring staged, as sparse_attention's)."""
        self._check_reads("block_attention", q, [("kv", kv, None), ("ring", ring, ring_spec)])
        return block_attention.block_attention(q, kv, ring, ring_spec, meta, sinks=sinks, scale=scale)

    def _check_reads(self, op: str, q: torch.Tensor, tensors: list) -> None:
        """Raise ValueError unless the kernels read q and `tensors` [(name, tensor, its CacheSpec or None)]."""
        why = None
        if not getattr(self.layout, "slot_is_row", False):
            why = f"the KV layout is {type(self.layout).__name__}, not one row per slot (KVLayout.slot_is_row)"
        elif q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            why = f"q is {q.dtype}; the kernels take float32, bfloat16 or float16"
        for name, t, spec in tensors if why is None else ():
            why = self._unreadable(name, t, spec, q)
            if why is not None:
                break
        if why is not None:
            raise ValueError(f"nvidia_sm100 {op}: {why}")

    @staticmethod
    def _unreadable(name: str, t: torch.Tensor, spec: CacheSpec | None, q: torch.Tensor) -> str | None:
        """Why the kernels cannot read cache `name` (a plain row of q's dtype, or packed in spec's format)."""
        dim = q.shape[-1]
        if spec is not None and spec.stored_format and t.dtype == torch.uint8:
            if spec.num_heads != 1 or tuple(t.shape[1:]) != (BlockFormat.of(spec.stored_format).row_bytes(dim),):
                fmt = spec.stored_format
                return f"{name} holds packed rows {tuple(t.shape[1:])}; the kernels read one {fmt} head of {dim} dims"
            return None
        if t.dtype != q.dtype:
            return f"{name} is {t.dtype} and q {q.dtype}; q and the caches must share one dtype"
        if spec is not None and (spec.num_heads != 1 or tuple(t.shape[1:]) != (1, dim)):
            return f"{name} holds entries {tuple(t.shape[1:])}; the kernels read one head of q's {dim} dims"
        return None

    def indexer_topk(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        keys_spec: CacheSpec,
        meta: AttentionMetadata,
        *,
        top_k: int,
        scale: float,
    ) -> torch.Tensor:
        """The scores kernel and a top-k on the device (kernels.indexer): the reference's entries, in its order,
        from the same scores (which may differ by rounding)."""
        self._check_reads("indexer_topk", q, [("keys", keys, keys_spec)])
        return indexer.indexer_topk(
            q, weights, keys, keys_spec, meta, self.block_size, top_k=top_k, scale=scale, stage=self.stage
        )

    def indexer_select(
        self, q, weights, keys, keys_spec, meta, *, top_k, scale, within=None, block_size=1, top_blocks=0
    ):
        """DeepSeek-V4.1's indexer (kernels.indexer); `block_size` is the candidate blocks' size in entries (not
        the KV cache's)."""
        self._check_reads("indexer_select", q, [("keys", keys, keys_spec)])
        return indexer.indexer_select(
            q, weights, keys, keys_spec, meta, self.block_size, top_k=top_k, scale=scale,
            within=within, candidate_block=block_size, top_blocks=top_blocks, stage=self.stage,
        )  # fmt: skip
