"""The op table and attention of the nvidia_sm100 backend: Triton kernels, cuBLAS (through torch) for
dense GEMMs in the default mode, the fixed-tiling Triton GEMM in batch-invariant mode and for FP8 weights
(ops.BlockFP8: each float8 tile is dequantized in registers with its block's scale, never in memory).

DeepSeek-V4's op features on those fast paths are Triton too: the swiglu limit (`silu_and_mul(limit=)`,
`expert_ffn(swiglu_limit=)`, fused into the same kernels) and sqrtsoftplus / hash routing (the routing
kernel); hc_pre (after torch's rms and mixing GEMM: the weights, Sinkhorn and the collapse in one kernel),
hc_post and softmax_pool are kernels (kernels.hyper), and so is V4's sparse_attention
(kernels.sparse_attention: one program per query token, no host reads, rows independent of the batch).
So is the lightning indexer, V4's indexer_topk and V4.1's indexer_select (kernels.indexer: a scores kernel,
then the top-k by torch ops on the device, no host reads). V4.1's other ops (V41_OPS) are the reference's
PyTorch code on the GPU for now, but for the op feature expert_row_scales (`expert_ffn(row_scales=)`),
fused into the grouped expert GEMM's epilogue.

Imported only after the backend is selected (it imports triton).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer_core.backend.ops import AttentionMetadata, BlockFP8, RoutingConfig
from deepinfer_core.kv.layout import CacheSpec, KVLayout
from deepinfer_core.reference.attention import ReferenceAttention
from deepinfer_core.reference.kv import ReferenceKVLayout
from deepinfer_core.reference.ops import ReferenceOps
from deepinfer_nvidia_sm100.kernels import attention, elementwise, gemm, hyper, indexer, moe, routing, sparse_attention

__all__ = ["NvidiaAttention", "NvidiaOps"]

Weight = torch.Tensor | BlockFP8  # a dense weight, or DeepSeek's FP8 format


class NvidiaOps:
    """Implements deepinfer_core.backend.ops.Ops and V4Ops on one GPU.

    batch_invariant: every op's result for a row must not depend on the other rows of the call. The
    row-local kernels and the grouped expert GEMM are so always; `linear` and `head_linear` then use
    the fixed-tiling Triton GEMM instead of cuBLAS, whose algorithm changes with the number of rows.
    V4's hc_pre normalises with torch ops, whose reductions are not promised to be batch-invariant (the
    capabilities say so, with V4's attention: "v4_batch_invariance").
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
        if self.batch_invariant or isinstance(weight, BlockFP8):  # FP8 weights: scaled in the Triton GEMM
            return gemm.matmul(x, weight, bias)
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
        """The rms normalisation in torch ops and the mixes by `linear` (as the reference: normalise, then
        multiply), then one kernel for the rest: pre / post, the comb matrix and its Sinkhorn iterations, the
        collapse of the streams."""
        flat = streams.flatten(1).float()  # [T, N * D]
        flat = flat * torch.rsqrt(flat.square().mean(dim=-1, keepdim=True) + norm_eps)
        mixes = self.linear(flat, fn.float())  # [T, (2 + N) N] or [T, N], float32
        return hyper.hc_mix(streams, mixes, scale, base, sinkhorn_iters, eps)

    def hc_post(
        self, block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        return hyper.hc_post(block_out, streams, post, comb)

    def softmax_pool(self, values: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return hyper.softmax_pool(values, logits)

    # DeepSeek-V4.1's ops: the reference's PyTorch code on the GPU tensors (correct, not tuned)
    _v41 = ReferenceOps()

    def hc_mixes(self, streams, fn, scale, base, *, sinkhorn_iters: int, eps: float, norm_eps: float):
        return self._v41.hc_mixes(streams, fn, scale, base, sinkhorn_iters=sinkhorn_iters, eps=eps, norm_eps=norm_eps)

    def hc_collapse(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return self._v41.hc_collapse(streams, pre)

    def hc_expand(self, block_out, streams, post, comb) -> torch.Tensor:
        return self._v41.hc_expand(block_out, streams, post, comb)

    def round_to_format(self, x: torch.Tensor, fmt: str) -> torch.Tensor:
        return self._v41.round_to_format(x, fmt)

    def engram_gate(self, streams, key, value, weight, dead, *, eps: float) -> torch.Tensor:
        return self._v41.engram_gate(streams, key, value, weight, dead, eps=eps)


class NvidiaAttention:
    """Implements AttentionOps (a Triton kernel), V4AttentionOps and V41AttentionOps over the row-per-slot
    caches of `ReferenceKVLayout` (paged, compressed paged, sliding-window rings).

    sparse_attention, indexer_topk and indexer_select are Triton kernels (the indexers' top-k by torch ops
    after their scores kernel), with no host reads; each falls back to the reference's PyTorch code on caches
    its kernel cannot read (see the methods).
    """

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.block_size = layout.block_size
        self._torch = ReferenceAttention(layout)

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
        """The Triton kernel (kernels.sparse_attention) where it reads the caches: ReferenceKVLayout's
        row-per-slot tensors, one cached head, and q, kv and the caches of one float32 / bfloat16 / float16
        dtype. Anything else (another layout, mixed or FP8 cache dtypes) falls back to the reference's
        PyTorch code, with the same result up to rounding."""
        args = dict(sinks=sinks, scale=scale, compressed=compressed, compressed_spec=compressed_spec, indices=indices)
        if self._kernel_reads(q, kv, ring, ring_spec, compressed, compressed_spec):
            return sparse_attention.sparse_attention(q, kv, ring, ring_spec, meta, self.block_size, **args)
        return self._torch.sparse_attention(q, kv, ring, ring_spec, meta, **args)

    def _kernel_reads(self, q, kv, ring, ring_spec, compressed, compressed_spec) -> bool:
        """Whether the sparse attention kernel can read these tensors (see sparse_attention)."""
        caches = [(ring, ring_spec)] + ([] if compressed is None else [(compressed, compressed_spec)])
        return (
            isinstance(self.layout, ReferenceKVLayout)
            and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and kv.dtype == q.dtype
            and all(c.dtype == q.dtype and s.num_heads == 1 and c.shape[1:] == (1, q.shape[-1]) for c, s in caches)
        )

    def _indexer_reads(self, q, keys, keys_spec) -> bool:
        """Whether the indexer's scores kernel can read these tensors (see indexer_topk)."""
        return (
            isinstance(self.layout, ReferenceKVLayout)
            and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and keys.dtype == q.dtype
            and keys_spec.num_heads == 1
            and keys.shape[1:] == (1, q.shape[-1])
        )

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
        """The scores kernel and a top-k on the device (kernels.indexer) where the kernel reads the keys:
        ReferenceKVLayout's row-per-slot tensor, one head, q and keys of one float32 / bfloat16 / float16
        dtype. Anything else falls back to the reference's PyTorch code. Both choose the same entries, in
        the same order, from the same scores (which may differ by rounding)."""
        if self._indexer_reads(q, keys, keys_spec):
            return indexer.indexer_topk(q, weights, keys, keys_spec, meta, self.block_size, top_k=top_k, scale=scale)
        return self._torch.indexer_topk(q, weights, keys, keys_spec, meta, top_k=top_k, scale=scale)

    def indexer_select(
        self, q, weights, keys, keys_spec, meta, *, top_k, scale, within=None, block_size=1, top_blocks=0
    ):
        """DeepSeek-V4.1's indexer; `block_size` is the candidate blocks' size in entries (not the KV cache's).
        The scores kernel and top-k's on the device (kernels.indexer) where the kernel reads the keys (as
        indexer_topk), else the reference's PyTorch code."""
        if self._indexer_reads(q, keys, keys_spec):
            return indexer.indexer_select(
                q, weights, keys, keys_spec, meta, self.block_size, top_k=top_k, scale=scale,
                within=within, candidate_block=block_size, top_blocks=top_blocks,
            )  # fmt: skip
        return self._torch.indexer_select(
            q, weights, keys, keys_spec, meta, top_k=top_k, scale=scale,
            within=within, block_size=block_size, top_blocks=top_blocks,
        )  # fmt: skip
