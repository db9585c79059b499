"""DeepSeek-V4.1's DSpark draft attention (block_attention) in torch ops on the device: no host reads and every
shape from the call's (q.shape, meta.max_query_len), so a CUDA graph can capture it.

Each sequence's block is padded to M rows, M = meta.max_query_len (the drafter's block length k) or, when the
caller does not know it, T. Its keys are one table [W + M, D]: the W ring slots of positions first - W ..
first - 1 (gathered through the layout, so a packed ring is decoded as the layout reads it), then the block's
own M rows; a key is masked (-inf) where its ring position is below max(window_start, 0) or its block row does
not exist. The sink logit joins the softmax as one more column, dropped after it; everything in float32.

Batch invariance: a row's logits, softmax and values see its own table only, whose length W + M is fixed when
meta.max_query_len is given; the two products are then the fixed-tiling Triton GEMM (kernels.gemm, each sequence
its own tiles, their shapes from W + M, H and D alone), so a row does not depend on the rest of the step.
Otherwise they are torch's batched GEMMs, whose algorithm may change with the number of sequences.
"""

from __future__ import annotations

import torch

from deepinfer_core.backend.ops import AttentionMetadata
from deepinfer_core.kv.layout import CacheSpec, KVLayout
from deepinfer_nvidia_sm100.kernels import gemm

__all__ = ["block_attention"]


def _products(a: torch.Tensor, b: torch.Tensor, fixed_tiles: bool) -> torch.Tensor:
    """a [B, M, K] @ b [B, N, K]^T -> [B, M, N], float32."""
    return gemm.batched_matmul(a, b) if fixed_tiles else torch.bmm(a, b.transpose(1, 2))


def _block_keys(
    kv: torch.Tensor, ring: torch.Tensor, spec: CacheSpec, layout: KVLayout, meta: AttentionMetadata, rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(keys [B, W + M, D] float32, seen [B, W + M] bool, block rows [B, M]: each block row's token row, clamped
    to the step's rows), for M = `rows`."""
    starts, window, device = meta.query_start_loc, spec.window, kv.device
    lengths = starts[1:] - starts[:-1]  # [B]
    first = meta.seq_lens - lengths  # [B]: each block's first position
    positions = first[:, None] + torch.arange(-window, 0, device=device)  # [B, W]
    in_ring = positions >= meta.window_starts.clamp(min=0)[:, None]  # stale, or before position 0: not seen
    slots = meta.seq_slots[:, None] * spec.ring_size + positions % spec.ring_size  # [B, W]
    earlier = layout.gather(ring, spec, slots.flatten()).view(*slots.shape, -1).float()  # [B, W, D]
    offsets = torch.arange(rows, device=device)
    own = offsets < lengths[:, None]  # [B, M]
    block_rows = (starts[:-1, None] + offsets).clamp(max=kv.shape[0] - 1)  # [B, M]
    keys = torch.cat([earlier, kv[block_rows].float()], dim=1)
    return keys, torch.cat([in_ring, own], dim=1), block_rows


def block_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    ring: torch.Tensor,
    ring_spec: CacheSpec,
    layout: KVLayout,
    meta: AttentionMetadata,
    *,
    sinks: torch.Tensor,
    scale: float,
    fixed_tiles: bool = False,
) -> torch.Tensor:
    """q [T, H, D], kv [T, D], ring read through `layout` -> [T, H, D] in q.dtype (AttentionOps.block_attention).
    fixed_tiles: the products by kernels.gemm's fixed tiling (batch-invariant mode) instead of torch's."""
    tokens, heads, dim = q.shape
    if tokens == 0:
        return torch.empty_like(q)
    rows = meta.max_query_len or tokens  # M: at least the longest block
    seqs = meta.seq_lens.shape[0]
    keys, seen, block_rows = _block_keys(kv, ring, ring_spec, layout, meta, rows)  # [B, S, D], [B, S], [B, M]
    queries = q[block_rows].float().flatten(1, 2)  # [B, M H, D]
    logits = _products(queries, keys, fixed_tiles) * scale  # [B, M H, S]
    logits = logits.masked_fill(~seen[:, None, :], float("-inf"))
    sink = sinks.float().repeat(rows).view(1, rows * heads, 1).expand(seqs, -1, 1)  # [B, M H, 1]
    probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
    out = _products(probs, keys.transpose(1, 2), fixed_tiles).view(seqs, rows, heads, dim)  # [B, M, H, D]
    # back to the step's rows: row t is row t - start of its sequence's block
    t = torch.arange(tokens, device=q.device)
    seq = torch.searchsorted(meta.query_start_loc[1:], t, right=True).clamp(max=seqs - 1)  # [T]
    offset = (t - meta.query_start_loc[seq]).clamp(max=rows - 1)
    return out[seq, offset].to(q.dtype)
