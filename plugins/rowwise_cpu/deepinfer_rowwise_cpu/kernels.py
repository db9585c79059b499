"""The op table (deepinfer_core.backend.ops.Ops) computed one token row at a time; imports only torch and the
contract types of deepinfer_core.backend.

Batch invariance by construction: every op loops over rows and gives each row a fresh, contiguous float32
copy (same shape, same alignment, same kernel call whatever the batch), so a row's result is the same
sequence of floating-point operations for any number of rows T. Matrix products are matrix-vector
products (torch.mv / a bmm of fixed shape per row); reductions run over one row. Each op computes in
float32 and rounds to the input dtype where the reference does: once at the end, except silu_and_mul
(silu(gate) is rounded before the product) and expert_ffn (rounded between its linear / silu_and_mul /
linear steps). moe_route returns float32 weights, as the contract says.
"""

from __future__ import annotations

import torch

from deepinfer_core.backend.ops import RoutingConfig

__all__ = ["RowwiseOps", "fresh_row"]


def fresh_row(row: torch.Tensor) -> torch.Tensor:
    """A new contiguous float32 copy of `row`: identical layout and alignment wherever the row came from."""
    out = torch.empty(row.shape, dtype=torch.float32, device=row.device)
    return out.copy_(row)


def _matvec(w: torch.Tensor, row: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """w [N, K] float32 @ row [K] (+ bias [N] float32) -> [N] in `dtype`: one matrix-vector product."""
    y = torch.mv(w, fresh_row(row))
    return (y if bias is None else y + bias).to(dtype)


def _silu_and_mul_row(row: torch.Tensor) -> torch.Tensor:
    """row [2I] = [gate | up] -> silu(gate) * up [I] in row.dtype. Like the reference, silu(gate) is rounded to
    row.dtype before the product (a no-op in float32); each step computes in float32."""
    r = fresh_row(row)
    gate, up = r[: r.shape[0] // 2], r[r.shape[0] // 2 :]
    silu = (gate * torch.sigmoid(gate)).to(row.dtype).float()
    return (silu * up).to(row.dtype)


class RowwiseOps:
    """Implements Ops. Every loop below is over token rows; nothing is batched across rows."""

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

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [T, 2I]
        inner = rows.shape[1] // 2
        out = torch.empty(rows.shape[0], inner, dtype=x.dtype, device=x.device)  # [T, I]
        for t in range(rows.shape[0]):
            out[t] = _silu_and_mul_row(rows[t])
        return out.view(*x.shape[:-1], inner)

    def moe_route(
        self, router_logits: torch.Tensor, config: RoutingConfig, correction_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, experts = router_logits.shape  # [T, E]
        weights = torch.empty(tokens, config.top_k, dtype=torch.float32, device=router_logits.device)  # [T, K]
        ids = torch.empty(tokens, config.top_k, dtype=torch.int64, device=router_logits.device)  # [T, K]
        bias = None if correction_bias is None else correction_bias.float()  # [E]
        grouped = config.method != "greedy" and config.num_groups > 1
        for t in range(tokens):
            logit = fresh_row(router_logits[t])  # [E]
            if config.scoring == "sigmoid":
                scores = torch.sigmoid(logit)
            else:
                e = torch.exp(logit - logit.max())
                scores = e / e.sum()
            choice = scores if bias is None else scores + bias  # ranks experts; weights use raw scores
            if grouped:
                groups = choice.view(config.num_groups, -1)  # [G, E/G]
                if config.method == "noaux_tc":
                    group_score = groups.topk(2, dim=-1).values.sum(dim=-1)  # [G]: sum of the two best
                else:
                    group_score = groups.amax(dim=-1)  # [G]: best expert of each group
                dropped = torch.ones(config.num_groups, dtype=torch.bool, device=logit.device)
                dropped[group_score.topk(config.topk_groups).indices] = False
                choice = groups.masked_fill(dropped[:, None], float("-inf")).reshape(experts)
            top = choice.topk(config.top_k).indices  # [K]
            w = scores[top]
            if config.normalize:
                w = w / (w.sum() + 1e-20)
            weights[t] = w * config.routed_scaling_factor
            ids[t] = top
        return weights, ids

    def expert_ffn(
        self, x: torch.Tensor, tokens_per_expert: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
    ) -> torch.Tensor:
        # Row t of expert e is exactly linear(silu_and_mul(linear(x_t, w13[e])), w2[e]) of this table: the
        # [2I] and [I] intermediates are rounded to x.dtype between the steps, as separate ops would.
        out = torch.empty_like(x)  # [N, D]
        start = 0
        for expert, count in enumerate(tokens_per_expert.tolist()):
            if count:
                w_in = w13[expert].float().contiguous()  # [2I, D]
                w_out = w2[expert].float().contiguous()  # [D, I]
                for t in range(start, start + count):
                    hidden = _silu_and_mul_row(_matvec(w_in, x[t], x.dtype))  # [I]
                    out[t] = _matvec(w_out, hidden, x.dtype)  # [D]
            start += count
        return out
