"""DeepSeek-V4's and V4.1's hyper-connections and the compressors' pooling, one launch each where the
reference takes dozens.

hc_norm: the rms normalisation of each token's flattened streams, in float32 (the input of the mixing GEMM,
which the caller does). hc_mix: from the mixes of one token, the pre / post weights, the comb matrix with all
its Sinkhorn iterations in registers, and the collapse of the N streams (V4's hc_pre) or pre itself (V4.1's
hc_mixes). hc_collapse: V4.1's collapse by a given pre. hc_post / hc_expand: the new streams, V4's and V4.1's
roundings. softmax_pool: a softmax over each window's slots and the weighted sum. Row-local (one program per
token, or per token and column block, or per entry; every reduction in an order fixed by the shapes of a row),
so batch-invariant; rounded where the reference rounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia_sm100.kernels._common import next_pow2

NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _hc_norm_kernel(streams_ptr, out_ptr, D, eps, ss_t, ss_n, N: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BN)
    live = j[:, None] < N
    rows = streams_ptr + t * ss_t + j[:, None] * ss_n
    squares = tl.zeros([BN, BD], dtype=tl.float32)
    for d0 in range(0, D, BD):  # lanes and order fixed by N and D: a row's sum does not depend on other rows
        d = d0 + tl.arange(0, BD)
        x = tl.load(rows + d[None, :], mask=live & (d[None, :] < D), other=0.0).to(tl.float32)
        squares += x * x
    rstd = tl.rsqrt(tl.sum(tl.sum(squares, axis=1), axis=0) / (N * D) + eps)
    out = out_ptr + t * N * D + j[:, None] * D
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        mask = live & (d[None, :] < D)
        x = tl.load(rows + d[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(out + d[None, :], x * rstd, mask=mask)


def hc_norm(streams: torch.Tensor, eps: float) -> torch.Tensor:
    """streams [T, N, D] -> [T, N * D] float32: each token's flattened streams x * rsqrt(mean(x^2) + eps)."""
    tokens, n, hidden = streams.shape
    if streams.stride(-1) != 1:
        streams = streams.contiguous()
    out = torch.empty((tokens, n * hidden), dtype=torch.float32, device=streams.device)
    if tokens:
        bn = next_pow2(n)
        _hc_norm_kernel[(tokens,)](
            streams, out, hidden, eps, streams.stride(0), streams.stride(1),
            N=n, BN=bn, BD=min(4096 // bn, next_pow2(hidden)),
        )  # fmt: skip
    return out


@triton.jit
def _collapse_block(rows, pre, live, out, d, D):
    """out[d] = sum_n pre_n rows_n[d] over one block of columns `d`: float32 products and sum, rounded once.
    rows [BN, 1] point at each stream's row, pre [BN] is 0 past N (`live`)."""
    x = tl.load(rows + d[None, :], mask=live[:, None] & (d[None, :] < D), other=0.0).to(tl.float32)
    tl.store(out + d, tl.sum(pre[:, None] * x, axis=0).to(out.dtype.element_ty), mask=d < D)


@triton.jit
def _hc_mix_kernel(
    streams_ptr, mixes_ptr, scale_ptr, base_ptr, out_ptr, post_ptr, comb_ptr, D, ITERS, eps,
    ss_t, ss_n, sm_t,
    N: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, HAS_COMB: tl.constexpr, COLLAPSE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BN)
    live = j < N
    mix = mixes_ptr + t * sm_t
    pre_logit = tl.load(mix + j, mask=live, other=0.0) * tl.load(scale_ptr)
    pre = tl.where(live, 1.0 / (1.0 + tl.exp(-(pre_logit + tl.load(base_ptr + j, mask=live, other=0.0)))) + eps, 0.0)
    if COLLAPSE:  # out: collapsed [T, D] = sum_n pre_n streams_n (V4's hc_pre)
        rows = streams_ptr + t * ss_t + j[:, None] * ss_n
        for d0 in range(0, D, BD):
            _collapse_block(rows, pre, live, out_ptr + t * D, d0 + tl.arange(0, BD), D)
    else:  # out: pre [T, N] (V4.1's hc_mixes)
        tl.store(out_ptr + t * N + j, pre, mask=live)
    if HAS_COMB:
        post_logit = tl.load(mix + N + j, mask=live, other=0.0) * tl.load(scale_ptr + 1)
        post = 2.0 / (1.0 + tl.exp(-(post_logit + tl.load(base_ptr + N + j, mask=live, other=0.0))))
        tl.store(post_ptr + t * N + j, post, mask=live)
        cell = live[:, None] & live[None, :]  # comb[j, k] = mixes[2N + j N + k]
        at = 2 * N + j[:, None] * N + j[None, :]
        logits = tl.load(mix + at, mask=cell, other=0.0) * tl.load(scale_ptr + 2)
        logits = tl.where(cell, logits + tl.load(base_ptr + at, mask=cell, other=0.0), NEG_INF)
        logits = tl.where(live[:, None], logits, 0.0)  # rows past N: finite, dropped below
        e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        comb = tl.where(cell, e / tl.sum(e, axis=1)[:, None] + eps, 0.0)  # softmax over k, + eps
        comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)  # Sinkhorn: columns, then rows and columns
        for _ in range(ITERS - 1):
            comb = comb / (tl.sum(comb, axis=1)[:, None] + eps)
            comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
        tl.store(comb_ptr + t * N * N + j[:, None] * N + j[None, :], comb, mask=cell)


def _collapse_tile(hidden: int) -> int:
    """The column block of a collapse: hc_pre's and hc_collapse's sums run in the same lanes (the same bits)."""
    return min(1024, next_pow2(hidden))


def hc_mix(
    streams: torch.Tensor,
    mixes: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    sinkhorn_iters: int,
    eps: float,
    *,
    collapse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """streams [T, N, D], mixes [T, (2 + N) N] or [T, N] float32 -> (collapsed [T, D] in streams.dtype,
    post [T, N], comb [T, N, N] float32), or (collapsed, None, None) for the head's N mixes. With
    collapse=False (V4.1), pre [T, N] float32 in place of collapsed."""
    tokens, n, hidden = streams.shape
    if streams.stride(-1) != 1:
        streams = streams.contiguous()
    mixes, scale, base = mixes.float().contiguous(), scale.float().contiguous(), base.float().contiguous()
    has_comb = mixes.shape[1] != n
    shape, dtype = ((tokens, hidden), streams.dtype) if collapse else ((tokens, n), torch.float32)
    out = torch.empty(shape, dtype=dtype, device=streams.device)
    post = torch.empty((tokens, n), dtype=torch.float32, device=streams.device) if has_comb else None
    comb = torch.empty((tokens, n, n), dtype=torch.float32, device=streams.device) if has_comb else None
    if tokens:
        _hc_mix_kernel[(tokens,)](
            streams, mixes, scale, base, out, post if has_comb else out, comb if has_comb else out,
            hidden, sinkhorn_iters, eps, streams.stride(0), streams.stride(1), mixes.stride(0),
            N=n, BN=next_pow2(n), BD=_collapse_tile(hidden), HAS_COMB=has_comb, COLLAPSE=collapse,
        )  # fmt: skip
    return out, post, comb


@triton.jit
def _hc_collapse_kernel(
    streams_ptr, pre_ptr, out_ptr, D, ss_t, ss_n, sp_t, N: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BN)
    live = j < N
    pre = tl.load(pre_ptr + t * sp_t + j, mask=live, other=0.0).to(tl.float32)
    rows = streams_ptr + t * ss_t + j[:, None] * ss_n
    _collapse_block(rows, pre, live, out_ptr + t * D, tl.program_id(1) * BD + tl.arange(0, BD), D)


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """streams [T, N, D], pre [T, N] -> [T, D] = sum_n pre_n streams_n in float32, rounded once to streams.dtype
    (bitwise hc_mix's collapse for the same pre)."""
    tokens, n, hidden = streams.shape
    if streams.stride(-1) != 1:
        streams = streams.contiguous()
    pre = pre.float().contiguous()
    out = torch.empty((tokens, hidden), dtype=streams.dtype, device=streams.device)
    block = _collapse_tile(hidden)
    if tokens:
        _hc_collapse_kernel[(tokens, triton.cdiv(hidden, block))](
            streams, pre, out, hidden, streams.stride(0), streams.stride(1), pre.stride(0),
            N=n, BN=next_pow2(n), BD=block,
        )  # fmt: skip
    return out


@triton.jit
def _hc_post_kernel(
    out_ptr, block_ptr, streams_ptr, post_ptr, comb_ptr, D, sb_t, ss_t, ss_n, sp_t, sc_t, sc_j,
    N: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, ROUND_TERMS: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    j = tl.arange(0, BN)
    live = j < N
    dtype = out_ptr.dtype.element_ty
    x = tl.load(
        streams_ptr + t * ss_t + j[:, None] * ss_n + d[None, :], mask=live[:, None] & (d[None, :] < D), other=0.0
    ).to(tl.float32)
    cell = live[:, None] & live[None, :]
    comb = tl.load(comb_ptr + t * sc_t + j[:, None] * sc_j + j[None, :], mask=cell, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * sp_t + j, mask=live, other=0.0).to(tl.float32)  # comb [j, k], post [k]
    if ROUND_TERMS:  # V4's hc_post: comb and post rounded to the streams' dtype as the reference does
        comb = comb.to(dtype).to(tl.float32)
        post = post.to(dtype).to(tl.float32)
    # mixed[k] = sum_j comb[j, k] x[j]: float32 products and sum (a GEMM's rounding, when rounded)
    mixed = tl.sum(comb[:, :, None] * x[:, None, :], axis=0)  # [BN (k), BD]
    b = tl.load(block_ptr + t * sb_t + d, mask=d < D, other=0.0).to(tl.float32)
    first = post[:, None] * b[None, :]
    if ROUND_TERMS:  # each term rounded, then their sum (V4.1's hc_expand: only the sum)
        mixed = mixed.to(dtype).to(tl.float32)
        first = first.to(dtype).to(tl.float32)
    out = (first + mixed).to(dtype)
    tl.store(out_ptr + t * N * D + j[:, None] * D + d[None, :], out, mask=live[:, None] & (d[None, :] < D))


def hc_post(
    block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *, round_terms: bool = True
) -> torch.Tensor:
    """block_out [T, D], streams [T, N, D], post [T, N], comb [T, N, N] -> new streams [T, N, D] in streams.dtype.
    round_terms: V4's hc_post (post, comb and both terms rounded to streams.dtype); else V4.1's hc_expand
    (all in float32, rounded once)."""
    tokens, n, hidden = streams.shape
    streams = streams if streams.stride(-1) == 1 else streams.contiguous()
    block_out = block_out if block_out.stride(-1) == 1 else block_out.contiguous()
    post, comb = post.contiguous(), comb.contiguous()
    out = torch.empty((tokens, n, hidden), dtype=streams.dtype, device=streams.device)
    block = min(256, next_pow2(hidden))
    if tokens:
        _hc_post_kernel[(tokens, triton.cdiv(hidden, block))](
            out, block_out, streams, post, comb, hidden, block_out.stride(0), streams.stride(0), streams.stride(1),
            post.stride(0), comb.stride(0), comb.stride(1), N=n, BN=next_pow2(n), BD=block, ROUND_TERMS=round_terms,
        )  # fmt: skip
    return out


@triton.jit
def _softmax_pool_kernel(
    values_ptr, logits_ptr, out_ptr, S, D, sv_n, sv_s, sl_n, sl_s, BS: tl.constexpr, BD: tl.constexpr
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    s = tl.arange(0, BS)
    mask = (s[:, None] < S) & (d[None, :] < D)
    logits = tl.load(logits_ptr + n * sl_n + s[:, None] * sl_s + d[None, :], mask=mask, other=NEG_INF)
    logits = tl.where(d[None, :] < D, logits.to(tl.float32), 0.0)  # columns past D: finite, not stored
    e = tl.exp(logits - tl.max(logits, axis=0)[None, :])  # -inf logits: weight 0
    dtype = out_ptr.dtype.element_ty
    weights = (e / tl.sum(e, axis=0)[None, :]).to(dtype).to(tl.float32)  # rounded to the values' dtype
    v = tl.load(values_ptr + n * sv_n + s[:, None] * sv_s + d[None, :], mask=mask, other=0.0).to(tl.float32)
    terms = (v * weights).to(dtype).to(tl.float32)  # each product in the values' dtype, the sum in float32
    tl.store(out_ptr + n * D + d, tl.sum(terms, axis=0).to(dtype), mask=d < D)


def softmax_pool(values: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """values, logits [N, S, D] -> [N, D] = sum over S of softmax_S(logits) * values, in values.dtype."""
    entries, span, hidden = values.shape
    values = values if values.stride(-1) == 1 else values.contiguous()
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    out = torch.empty((entries, hidden), dtype=values.dtype, device=values.device)
    block = min(128, next_pow2(hidden), max(16, 8192 // next_pow2(span)))
    if entries:
        _softmax_pool_kernel[(entries, triton.cdiv(hidden, block))](
            values, logits, out, span, hidden, values.stride(0), values.stride(1), logits.stride(0), logits.stride(1),
            BS=next_pow2(span), BD=block,
        )  # fmt: skip
    return out
