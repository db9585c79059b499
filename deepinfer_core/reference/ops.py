"""Reference dense and MoE ops: the obvious PyTorch formula for each op of the contract."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer_core.backend.ops import RoutingConfig, block_length, check_layer_fn
from deepinfer_core.backend.weight_formats import Weight, dequantized
from deepinfer_core.kv.formats import round_blocks

__all__ = ["ReferenceOps"]


def _descending(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last dim; equal scores go to the lower index (the contract's tie rule)."""
    return scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]


class ReferenceOps:
    """Implements deepinfer_core.backend.ops.Ops; float32 accumulation, results in the input dtype."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
        return (normed * weight.float()).to(x.dtype)

    def rotary(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool
    ) -> torch.Tensor:
        c = cos[positions].float()[:, None, :]  # [T, 1, R/2]
        s = sin[positions].float()[:, None, :]
        x32 = x.float()
        if interleaved:
            a, b = x32[..., 0::2], x32[..., 1::2]  # pairs (2i, 2i+1)
        else:
            a, b = x32.chunk(2, dim=-1)  # pairs (i, i + R/2)
        ra, rb = a * c - b * s, b * c + a * s
        out = torch.stack((ra, rb), dim=-1).flatten(-2) if interleaved else torch.cat((ra, rb), dim=-1)
        return out.to(x.dtype)

    def linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, dequantized(weight, x.dtype), bias)  # a quantized weight: the value it stands for

    def head_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.einsum("thk,hnk->thn", x, weight)

    def silu_and_mul(self, x: torch.Tensor, *, limit: float | None = None) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return F.silu(gate) * up

    def moe_route(
        self,
        router_logits: torch.Tensor,
        config: RoutingConfig,
        correction_bias: torch.Tensor | None = None,
        *,
        expert_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = router_logits.float()  # [T, E]
        if config.scoring == "sigmoid":
            scores = logits.sigmoid()
        elif config.scoring == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        else:
            scores = logits.softmax(dim=-1)
        choice = scores if correction_bias is None else scores + correction_bias.float()  # ranks experts
        tokens = scores.shape[0]
        if config.method == "hash":
            if expert_ids is None:
                raise ValueError("hash routing needs expert_ids (the token id -> experts table's rows)")
            choice = None
        elif config.method != "greedy" and config.num_groups > 1:
            experts = choice.shape[1]  # sizes spelled out: an idle forward has no tokens
            grouped = choice.view(tokens, config.num_groups, experts // config.num_groups)  # [T, G, E/G]
            if config.method == "noaux_tc":
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
            else:
                group_scores = grouped.max(dim=-1).values
            kept_groups = _descending(group_scores, config.topk_groups)  # [T, topk_groups], ties: lower group
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
            expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(tokens, experts)
            choice = choice.masked_fill(~expert_mask, float("-inf"))
        ids = expert_ids.long() if choice is None else _descending(choice, config.top_k)  # [T, K], ties: lower id
        weights = scores.gather(1, ids)  # weighted by the raw score, not the bias-corrected one
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
        swiglu_limit: float | None = None,
        row_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        w13, w2 = dequantized(w13, x.dtype), dequantized(w2, x.dtype)
        out = torch.empty_like(x)
        start = 0
        for expert, count in enumerate(tokens_per_expert.tolist()):
            if count:
                rows = x[start : start + count]  # [n, D]
                gate_up = F.linear(rows, w13[expert])  # [n, 2I]
                if row_scales is None:
                    hidden = self.silu_and_mul(gate_up, limit=swiglu_limit)  # [n, I]
                else:  # scaled in float32, rounded once
                    scales = row_scales[start : start + count, None].float()
                    hidden = (self.silu_and_mul(gate_up.float(), limit=swiglu_limit) * scales).to(x.dtype)
                out[start : start + count] = F.linear(hidden, w2[expert])
            start += count
        return out

    def _hc_weights(
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
        """(pre [T, N], post [T, N], comb [T, N, N]) float32; post and comb None for the head form fn [N, N*D]."""
        n = streams.shape[1]
        flat = streams.flatten(1).float()  # [T, N * D]
        flat = flat * torch.rsqrt(flat.square().mean(dim=-1, keepdim=True) + norm_eps)
        mixes = F.linear(flat, fn.float())  # [T, (2 + N) N] or [T, N]
        scale, base = scale.float(), base.float()
        pre = torch.sigmoid(mixes[:, :n] * scale[0] + base[:n]) + eps  # [T, N]
        if fn.shape[0] == n:
            return pre, None, None
        post = 2 * torch.sigmoid(mixes[:, n : 2 * n] * scale[1] + base[n : 2 * n])
        comb = (mixes[:, 2 * n :] * scale[2] + base[2 * n :]).unflatten(1, (n, n)).softmax(dim=-1) + eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        for _ in range(sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        return pre, post, comb

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
        pre, post, comb = self._hc_weights(
            streams, fn, scale, base, sinkhorn_iters=sinkhorn_iters, eps=eps, norm_eps=norm_eps
        )
        return self.hc_collapse(streams, pre), post, comb

    def hc_post(
        self, block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        dtype = streams.dtype
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)  # [T, N, D]: sum_j comb[j, k] X_j
        return post.to(dtype)[:, :, None] * block_out[:, None, :] + mixed

    def softmax_pool(self, values: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        weights = logits.float().softmax(dim=1).to(values.dtype)  # [N, S, D]
        return (values * weights).sum(dim=1)

    # DeepSeek-V4.1 (V41Ops)

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
        check_layer_fn(streams, fn)
        return self._hc_weights(streams, fn, scale, base, sinkhorn_iters=sinkhorn_iters, eps=eps, norm_eps=norm_eps)

    def hc_collapse(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return (pre.float()[:, :, None] * streams.float()).sum(dim=1).to(streams.dtype)  # [T, D]

    def hc_expand(
        self, block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        mixed = torch.matmul(comb.float().transpose(-1, -2), streams.float())  # [T, N, D]: sum_j comb[j, k] X_j
        return (post.float()[:, :, None] * block_out.float()[:, None, :] + mixed).to(streams.dtype)

    def round_to_format(self, x: torch.Tensor, fmt: str) -> torch.Tensor:
        block_length(fmt, x)  # the contract's refusals
        return round_blocks(x, fmt)

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
        h, k = streams.float(), key.float()  # [T, N, D]
        rstd = torch.rsqrt(h.square().mean(dim=-1) + eps) * torch.rsqrt(k.square().mean(dim=-1) + eps)  # [T, N]
        dot = (h * weight.float() * k).sum(dim=-1) * rstd * h.shape[-1] ** -0.5  # [T, N]
        gate = torch.sigmoid(dot.sign() * dot.abs().clamp_min(1e-6).sqrt())
        gate = gate.masked_fill(dead.bool()[:, None], 0.0)  # dead (pad / image) tokens take no memory
        return (h + gate[:, :, None] * value.float()[:, None, :]).to(streams.dtype)
