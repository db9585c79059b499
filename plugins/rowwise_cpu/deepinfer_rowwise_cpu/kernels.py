"""The op table (deepinfer_core.backend.ops.Ops) computed one token row at a time; imports only torch, the
contract types of deepinfer_core.backend and this package's block formats.

Batch invariance by construction: every op loops over rows and gives each row a fresh, contiguous float32
copy (same shape, same alignment, same kernel call whatever the batch), so a row's result is the same
sequence of floating-point operations for any number of rows T. Matrix products are matrix-vector
products (torch.mv / a bmm of fixed shape per row); reductions run over one row. Each op computes in
float32 and rounds to the input dtype where the reference does: once at the end, except silu_and_mul
(silu(gate) is rounded before the product) and expert_ffn (rounded between its linear / silu_and_mul /
linear steps; with DeepSeek-V4.1's row scales the activation stays float32 until it is scaled, then is rounded
once). moe_route returns float32 weights, as the contract says.

DeepSeek-V4's dense ops are here too: the swiglu limit of silu_and_mul / expert_ffn, sqrtsoftplus scoring
and hash routing in moe_route, and the hyper-connection and compressor ops hc_pre, hc_post and
softmax_pool (deepinfer_core.backend.ops.V4Ops), each one row at a time like the rest. So are DeepSeek-V4.1's
(V41Ops): hc_mixes (hc_pre's weights without the collapse), hc_collapse (hc_pre's collapse, the same kernel
call), hc_expand (hc_post's formula in float32 with one rounding at the end), round_to_format (each row's
blocks through formats.round_blocks) and engram_gate.
"""

from __future__ import annotations

import torch

from deepinfer_core.backend.ops import RoutingConfig
from deepinfer_rowwise_cpu.formats import block_channels, round_blocks

__all__ = ["RowwiseOps", "fresh_row"]


def fresh_row(row: torch.Tensor) -> torch.Tensor:
    """A new contiguous float32 copy of `row`: identical layout and alignment wherever the row came from."""
    out = torch.empty(row.shape, dtype=torch.float32, device=row.device)
    return out.copy_(row)


def _matvec(w: torch.Tensor, row: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """w [N, K] float32 @ row [K] (+ bias [N] float32) -> [N] in `dtype`: one matrix-vector product."""
    y = torch.mv(w, fresh_row(row))
    return (y if bias is None else y + bias).to(dtype)


def _silu_and_mul_row(row: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """row [2I] = [gate | up] -> silu(gate) * up [I] in row.dtype. Like the reference, silu(gate) is rounded to
    row.dtype before the product (a no-op in float32); each step computes in float32. With `limit` (V4's
    swiglu limit) gate is first capped at +limit and up clipped to [-limit, limit], each rounded to
    row.dtype as a clamp in that dtype would be (the limit itself may not be representable)."""
    r = fresh_row(row)
    gate, up = r[: r.shape[0] // 2], r[r.shape[0] // 2 :]
    if limit is not None:
        gate = torch.clamp(gate, max=limit).to(row.dtype).float()
        up = torch.clamp(up, min=-limit, max=limit).to(row.dtype).float()
    silu = (gate * torch.sigmoid(gate)).to(row.dtype).float()
    return (silu * up).to(row.dtype)


def _scaled_activation_row(row: torch.Tensor, scale: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """row [2I] = [gate | up] (already rounded to row.dtype) -> scale * silu(gate) * up [I] in row.dtype, with
    one rounding at the end: DeepSeek-V4.1's routing weight `scale` (a float32 scalar) applied before w2. Unlike
    _silu_and_mul_row, nothing is rounded on the way: the clamp (V4's limit) and silu stay float32."""
    r = fresh_row(row)
    gate, up = r[: r.shape[0] // 2], r[r.shape[0] // 2 :]
    if limit is not None:
        gate, up = torch.clamp(gate, max=limit), torch.clamp(up, min=-limit, max=limit)
    return (gate * torch.sigmoid(gate) * up * scale).to(row.dtype)


def _scores(logit: torch.Tensor, scoring: str) -> torch.Tensor:
    """One token's router logits [E] float32 -> expert scores [E]: softmax, sigmoid or sqrt(softplus)."""
    if scoring == "sigmoid":
        return torch.sigmoid(logit)
    if scoring == "sqrtsoftplus":  # softplus(x) = max(x, 0) + log(1 + e^-|x|), overflow-free
        return torch.sqrt(torch.clamp(logit, min=0) + torch.log1p(torch.exp(-logit.abs())))
    e = torch.exp(logit - logit.max())
    return e / e.sum()


def _sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """One token's comb [N, N] (rows j, columns k) -> divided by its column sums (+ eps), then iters - 1
    times by its row sums, then its column sums (+ eps each time)."""
    comb = comb / (comb.sum(dim=0, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=0, keepdim=True) + eps)
    return comb


def _hc_weights(
    r: torch.Tensor,
    mixer: torch.Tensor,
    s: torch.Tensor,
    b: torch.Tensor,
    n: int,
    sinkhorn_iters: int,
    eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One token's N streams side by side r [N D] float32 -> its hyper-connection weights pre [N], post [N] and
    comb [N, N] (post and comb None for the head's mixer [N, N D], which makes pre alone)."""
    inv = torch.rsqrt(torch.dot(r, r) / r.numel() + norm_eps)  # 0-d: rms without weight
    mixes = torch.mv(mixer, r * inv)  # [(2 + N) N] or [N]
    pre = torch.sigmoid(mixes[:n] * s[0] + b[:n]) + eps  # [N]
    if mixer.shape[0] == n:
        return pre, None, None
    post = 2 * torch.sigmoid(mixes[n : 2 * n] * s[1] + b[n : 2 * n])  # [N]
    logits = (mixes[2 * n :] * s[2] + b[2 * n :]).view(n, n)  # [N, N], softmax over the last dim
    e = torch.exp(logits - logits.amax(dim=1, keepdim=True))
    return pre, post, _sinkhorn(e / e.sum(dim=1, keepdim=True) + eps, sinkhorn_iters, eps)


def _collapse(r: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """One token's streams r [N, D] float32 and weights pre [N] -> sum_n pre_n r_n [D] float32 (one mv)."""
    return torch.mv(r.t(), pre)


class RowwiseOps:
    """Implements Ops, V4Ops and V41Ops. Every loop below is over token rows; nothing is batched across rows."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [T, D]
        w = weight.float()  # [D]
        out = torch.empty_like(rows)
        for t in range(rows.shape[0]):
            r = fresh_row(rows[t])  # [D]
            inv = torch.rsqrt(torch.dot(r, r) / r.numel() + eps)  # 0-d
            out[t] = r * inv * w
        return out.view(x.shape)

    def rotary(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool
    ) -> torch.Tensor:
        tokens, heads, rot = x.shape  # [T, H, R]
        half = rot // 2
        out = torch.empty_like(x)
        for t, pos in enumerate(positions.tolist()):
            r = fresh_row(x[t])  # [H, R]
            if interleaved:
                pairs = r.view(heads, half, 2)  # pairs (2i, 2i+1)
            else:
                pairs = torch.stack((r[:, :half], r[:, half:]), dim=-1)  # pairs (i, i + R/2): [H, R/2, 2]
            z = torch.view_as_complex(pairs)  # [H, R/2] complex64
            turn = torch.complex(cos[pos].float(), sin[pos].float())  # [R/2]: e^{i * angle}
            rotated = torch.view_as_real(z * turn)  # [H, R/2, 2]
            if interleaved:
                out[t] = rotated.flatten(-2)
            else:
                out[t] = torch.cat((rotated[..., 0], rotated[..., 1]), dim=-1)
        return out

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [T, K]
        w = weight.float().contiguous()  # [N, K]
        b = None if bias is None else bias.float()  # [N]
        out = torch.empty(rows.shape[0], w.shape[0], dtype=x.dtype, device=x.device)  # [T, N]
        for t in range(rows.shape[0]):
            out[t] = _matvec(w, rows[t], x.dtype, b)  # [N]: one matrix-vector product per row
        return out.view(*x.shape[:-1], w.shape[0])

    def head_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        w = weight.float().contiguous()  # [H, N, K]
        out = torch.empty(x.shape[0], w.shape[0], w.shape[1], dtype=x.dtype, device=x.device)  # [T, H, N]
        for t in range(x.shape[0]):
            r = fresh_row(x[t])  # [H, K]
            out[t] = torch.bmm(w, r.unsqueeze(-1)).squeeze(-1)  # H matrix-vector products, fixed shape
        return out

    def silu_and_mul(self, x: torch.Tensor, *, limit: float | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [T, 2I]
        inner = rows.shape[1] // 2
        out = torch.empty(rows.shape[0], inner, dtype=x.dtype, device=x.device)  # [T, I]
        for t in range(rows.shape[0]):
            out[t] = _silu_and_mul_row(rows[t], limit)
        return out.view(*x.shape[:-1], inner)

    def moe_route(
        self,
        router_logits: torch.Tensor,
        config: RoutingConfig,
        correction_bias: torch.Tensor | None = None,
        *,
        expert_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, experts = router_logits.shape  # [T, E]
        if config.method == "hash" and expert_ids is None:
            raise ValueError(
                "hash routing takes its experts from expert_ids [T, top_k] (the token id -> experts table)"
            )
        weights = torch.empty(tokens, config.top_k, dtype=torch.float32, device=router_logits.device)  # [T, K]
        ids = torch.empty(tokens, config.top_k, dtype=torch.int64, device=router_logits.device)  # [T, K]
        bias = None if correction_bias is None else correction_bias.float()  # [E]
        grouped = config.method not in ("greedy", "hash") and config.num_groups > 1
        for t in range(tokens):
            scores = _scores(fresh_row(router_logits[t]), config.scoring)  # [E]
            if config.method == "hash":
                top = expert_ids[t].to(device=scores.device, dtype=torch.int64)  # [K]: given, only weighed here
            else:
                choice = scores if bias is None else scores + bias  # ranks experts; weights use raw scores
                if grouped:
                    groups = choice.view(config.num_groups, -1)  # [G, E/G]
                    if config.method == "noaux_tc":
                        group_score = groups.topk(2, dim=-1).values.sum(dim=-1)  # [G]: sum of the two best
                    else:
                        group_score = groups.amax(dim=-1)  # [G]: best expert of each group
                    dropped = torch.ones(config.num_groups, dtype=torch.bool, device=scores.device)
                    dropped[group_score.sort(descending=True, stable=True).indices[: config.topk_groups]] = False
                    choice = groups.masked_fill(dropped[:, None], float("-inf")).reshape(experts)
                top = choice.sort(descending=True, stable=True).indices[: config.top_k]  # [K]: ties to the lower id
            w = scores[top]
            if config.normalize:
                w = w / (w.sum() + 1e-20)
            weights[t] = w * config.routed_scaling_factor
            ids[t] = top
        return weights, ids

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
        # Row t of expert e is exactly linear(silu_and_mul(linear(x_t, w13[e]), limit), w2[e]) of this table: the
        # [2I] and [I] intermediates are rounded to x.dtype between the steps, as separate ops would. With
        # row_scales [N] (V4.1) the [I] activation is row_scales[t] * silu(gate) * up, rounded once.
        if row_scales is not None and tuple(row_scales.shape) != (x.shape[0],):
            raise ValueError(
                f"row_scales has shape {tuple(row_scales.shape)}; expected one scale per row of x, ({x.shape[0]},)"
            )
        scales = None if row_scales is None else row_scales.float()  # [N]
        out = torch.empty_like(x)  # [N, D]
        start = 0
        for expert, count in enumerate(tokens_per_expert.tolist()):
            if count:
                w_in = w13[expert].float().contiguous()  # [2I, D]
                w_out = w2[expert].float().contiguous()  # [D, I]
                for t in range(start, start + count):
                    gate_up = _matvec(w_in, x[t], x.dtype)  # [2I]
                    if scales is None:
                        hidden = _silu_and_mul_row(gate_up, swiglu_limit)  # [I]
                    else:
                        hidden = _scaled_activation_row(gate_up, scales[t], swiglu_limit)  # [I]
                    out[t] = _matvec(w_out, hidden, x.dtype)  # [D]
            start += count
        return out

    # ------------------------------------------------------------------ DeepSeek-V4 (V4Ops)

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
        tokens, n, dim = streams.shape  # [T, N, D]
        mixer = fn.float().contiguous()  # [(2 + N) N, N D] or [N, N D]
        s, b = scale.float(), base.float()  # [3] or [1], [(2 + N) N] or [N]
        full = mixer.shape[0] != n  # pre | post | comb, or (the head) pre alone
        collapsed = torch.empty(tokens, dim, dtype=streams.dtype, device=streams.device)  # [T, D]
        post = torch.empty(tokens, n, device=streams.device) if full else None  # [T, N] float32
        comb = torch.empty(tokens, n, n, device=streams.device) if full else None  # [T, N, N] float32
        for t in range(tokens):
            r = fresh_row(streams[t])  # [N, D]
            pre, row_post, row_comb = _hc_weights(r.view(n * dim), mixer, s, b, n, sinkhorn_iters, eps, norm_eps)
            collapsed[t] = _collapse(r, pre).to(streams.dtype)
            if full:
                post[t], comb[t] = row_post, row_comb
        return collapsed, post, comb

    def hc_post(
        self, block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        # out_k = post_k * block_out + sum_j comb[j, k] streams_j. As in the reference, post and comb are
        # rounded to streams.dtype first, and the two terms each once before their sum (no-ops in float32).
        dtype = streams.dtype
        out = torch.empty_like(streams)  # [T, N, D]
        for t in range(streams.shape[0]):
            mix = fresh_row(comb[t].to(dtype))  # [N, N]: comb[j, k]
            mixed = torch.mm(mix.t(), fresh_row(streams[t])).to(dtype)  # [N, D]: sum_j comb[j, k] streams_j
            gain = fresh_row(post[t].to(dtype))  # [N]
            scaled = (gain[:, None] * fresh_row(block_out[t])[None, :]).to(dtype)  # [N, D]
            out[t] = (scaled.float() + mixed.float()).to(dtype)
        return out

    def softmax_pool(self, values: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        # Per row i and channel d: sum_s softmax_s(logits[i, :, d]) * values[i, s, d]. As in the reference,
        # the weights and each weighted value are rounded to values.dtype, the sum accumulated in float32.
        dtype = values.dtype
        out = torch.empty(values.shape[0], values.shape[2], dtype=dtype, device=values.device)  # [N, D]
        for i in range(values.shape[0]):
            lg = fresh_row(logits[i])  # [S, D]
            e = torch.exp(lg - lg.amax(dim=0, keepdim=True))  # -inf logits: weight 0
            weights = (e / e.sum(dim=0, keepdim=True)).to(dtype)  # [S, D]
            weighted = (weights.float() * fresh_row(values[i])).to(dtype)  # [S, D]
            out[i] = weighted.float().sum(dim=0).to(dtype)
        return out

    # ------------------------------------------------------------------ DeepSeek-V4.1 (V41Ops)

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
        tokens, n, dim = streams.shape  # [T, N, D]
        if fn.shape[0] != (2 + n) * n:
            raise ValueError(
                f"hc_mixes takes a layer's mixer fn [(2 + N) N, N D] = [{(2 + n) * n}, {n * dim}] for {n} streams, "
                f"not {list(fn.shape)} (the head's [N, N D] form goes to hc_pre)"
            )
        mixer, s, b = fn.float().contiguous(), scale.float(), base.float()
        pre = torch.empty(tokens, n, device=streams.device)  # [T, N] float32
        post = torch.empty(tokens, n, device=streams.device)  # [T, N] float32
        comb = torch.empty(tokens, n, n, device=streams.device)  # [T, N, N] float32
        for t in range(tokens):
            r = fresh_row(streams[t]).view(n * dim)  # [N D]: the N streams side by side
            pre[t], post[t], comb[t] = _hc_weights(r, mixer, s, b, n, sinkhorn_iters, eps, norm_eps)
        return pre, post, comb

    def hc_collapse(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        # the same kernel call as hc_pre's collapse: bitwise equal to it for the same pre
        out = torch.empty(streams.shape[0], streams.shape[2], dtype=streams.dtype, device=streams.device)  # [T, D]
        for t in range(streams.shape[0]):
            out[t] = _collapse(fresh_row(streams[t]), fresh_row(pre[t])).to(streams.dtype)
        return out

    def hc_expand(
        self, block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        # out_k = post_k * block_out + sum_j comb[j, k] streams_j, all float32, rounded once (unlike hc_post)
        out = torch.empty_like(streams)  # [T, N, D]
        for t in range(streams.shape[0]):
            mixed = torch.mm(fresh_row(comb[t]).t(), fresh_row(streams[t]))  # [N, D]: sum_j comb[j, k] streams_j
            scaled = fresh_row(post[t])[:, None] * fresh_row(block_out[t])[None, :]  # [N, D]
            out[t] = (scaled + mixed).to(streams.dtype)
        return out

    def round_to_format(self, x: torch.Tensor, fmt: str) -> torch.Tensor:
        block = block_channels(fmt)
        if x.shape[-1] % block:
            raise ValueError(
                f"{fmt} rounds blocks of {block} channels along the last dim, which is {x.shape[-1]} here: "
                f"pass a tensor whose last dim is a multiple of {block}"
            )
        rows = x.reshape(-1, x.shape[-1])  # [R, L]: every leading index is a row
        out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
        for i in range(rows.shape[0]):
            stored = round_blocks(fresh_row(rows[i]).view(-1, block), fmt)  # [L / block, block] float32
            out[i] = stored.view(-1).to(x.dtype)  # exact: every stored value is a bfloat16
        return out.view(x.shape)

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
        dim = streams.shape[2]
        w = weight.float()  # [N, D]: q_weight * k_weight
        out = torch.empty_like(streams)  # [T, N, D]
        for t, is_dead in enumerate(dead.bool().tolist()):
            h, k = fresh_row(streams[t]), fresh_row(key[t])  # [N, D] each
            rstd = torch.rsqrt((h * h).mean(dim=1) + eps) * torch.rsqrt((k * k).mean(dim=1) + eps)  # [N]
            dot = (h * w * k).sum(dim=1) * rstd * dim**-0.5  # [N]
            gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(torch.clamp(dot.abs(), min=1e-6)))  # [N]
            if is_dead:  # pad / image tokens take nothing from the memory
                gate = torch.zeros_like(gate)
            out[t] = (h + gate[:, None] * fresh_row(value[t])[None, :]).to(streams.dtype)  # one rounding
        return out
