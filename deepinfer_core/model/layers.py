"""DeepSeek layers written against the backend contract: MLA attention, dense MLP, routed MoE.

No device-specific code: every heavy op is a call on the resolved backend (ops, attention, KV layout,
expert communicator). Shapes: T tokens in the step, D hidden, H heads, C = kv_lora_rank, R rope dims.
"""

from __future__ import annotations

import torch

from deepinfer_core.backend.ops import AttentionMetadata, RoutingConfig
from deepinfer_core.backend.resolve import ResolvedBackend
from deepinfer_core.backend.weight_formats import concat_rows, stack
from deepinfer_core.kv.layout import CacheSpec
from deepinfer_core.model.config import DeepseekConfig
from deepinfer_core.parallel.expert_slots import ExpertSlots

__all__ = ["DenseMLP", "MLAttention", "MoE", "moe_layers"]

Weights = dict[str, torch.Tensor]


class DenseMLP:
    """down(silu(gate(x)) * up(x)), with gate and up fused into one GEMM; `limit` is V4's swiglu_limit.
    `float_activation` (V4.1) computes the activation in float32 from the projections and rounds it once."""

    def __init__(
        self,
        backend: ResolvedBackend,
        gate: torch.Tensor,
        up: torch.Tensor,
        down: torch.Tensor,
        limit: float | None,
        *,
        float_activation: bool = False,
    ) -> None:
        self.ops, self.limit, self.float_activation = backend.ops, limit, float_activation
        self.w13 = concat_rows([gate, up], backend.dtype)  # [2I, D]
        self.w2 = down  # [D, I]

    @classmethod
    def from_weights(cls, backend: ResolvedBackend, w: Weights, prefix: str) -> DenseMLP:
        """From Hugging Face names: {prefix}.gate_proj / up_proj / down_proj."""
        return cls(backend, *(w[f"{prefix}.{n}_proj.weight"] for n in ("gate", "up", "down")), None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.ops.linear(x, self.w13)
        if self.float_activation:
            gate_up = gate_up.float()
        activated = self.ops.silu_and_mul(gate_up, **_limit(self.limit, "limit"))
        return self.ops.linear(activated.to(x.dtype), self.w2)


def _limit(limit: float | None, keyword: str) -> dict[str, float]:
    """The swiglu-limit keyword only when there is a limit: backends without V4 ops keep their signature."""
    return {} if limit is None else {keyword: limit}


class MoE:
    """Routed experts plus always-on shared experts.

    `experts` holds (gate, up, down) of every expert; this rank keeps those its communicator assigns it.
    Hash routing (V4) takes the experts from `hash_table` [vocab, top_k] by token id. `weight_before_down`
    (V4.1) applies the routing weight to the activation, before w2 (expert_ffn's row_scales), instead of to
    the expert's output.
    """

    def __init__(
        self,
        backend: ResolvedBackend,
        routing: RoutingConfig,
        gate: torch.Tensor,
        bias: torch.Tensor | None,
        experts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        shared: DenseMLP | None,
        *,
        limit: float | None = None,
        hash_table: torch.Tensor | None = None,
        weight_before_down: bool = False,
    ) -> None:
        self.ops, self.comm, self.routing, self.limit = backend.ops, backend.communicator, routing, limit
        self.weight_before_down, self.dtype = weight_before_down, backend.dtype
        self.calls = 0  # forwards through this layer (parallel/lockstep.py counts them per model forward)
        self.expert_rows = 0  # rows (token x expert pairs) this rank's experts computed: the moe_lb ratio's load
        self.load: torch.Tensor | None = None  # [E] tokens routed to each expert, where EPLB counts them
        self.gate, self.bias, self.shared, self.hash_table = gate, bias, shared, hash_table  # gate [E, D] float32
        # which copy of which expert each physical slot holds; this rank holds its share of the slots
        self.slots = ExpertSlots.default(routing.num_experts, self.comm.world_size, gate.device)
        local = [experts[e] for e in self.slots.held_by(self.comm.rank, self.comm.world_size)]
        w13 = [concat_rows([gate_w, up_w], backend.dtype) for gate_w, up_w, _ in local]
        self.w13 = stack(w13, backend.dtype)  # [E_local, 2I, D]: quantized where every expert's is, else dense
        self.w2 = stack([down for _, _, down in local], backend.dtype)  # [E_local, D, I]

    @classmethod
    def from_weights(cls, backend: ResolvedBackend, config: DeepseekConfig, w: Weights, prefix: str) -> MoE:
        """From Hugging Face V2/V3 names under {prefix} (mlp.gate, mlp.experts.{e}, mlp.shared_experts)."""
        experts = [
            tuple(w[f"{prefix}.experts.{e}.{n}_proj.weight"] for n in ("gate", "up", "down"))
            for e in range(config.n_routed_experts)
        ]
        shared = DenseMLP.from_weights(backend, w, f"{prefix}.shared_experts") if config.n_shared_experts else None
        bias = w.get(f"{prefix}.gate.e_score_correction_bias")
        return cls(backend, config.routing, w[f"{prefix}.gate.weight"], bias, experts, shared)

    def idle(self) -> None:
        """This layer with no tokens of this rank's: its dispatch and combine still run, and its experts still
        serve the rows other ranks send (expert parallelism: every rank takes part in every MoE layer)."""
        x = torch.empty((0, self.gate.shape[1]), dtype=self.dtype, device=self.gate.device)
        self(x, torch.empty((0,), dtype=torch.int64, device=self.gate.device))

    def __call__(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        self.calls += 1
        router_logits = self.ops.linear(x.float(), self.gate)  # [T, E], routed in float32
        if self.hash_table is None:
            weights, ids = self.ops.moe_route(router_logits, self.routing, self.bias)  # [T, K]
        else:
            table = self.hash_table[token_ids]
            weights, ids = self.ops.moe_route(router_logits, self.routing, self.bias, expert_ids=table)
        kwargs = _limit(self.limit, "swiglu_limit")
        if self.load is not None:
            self.load.scatter_add_(0, ids.reshape(-1), torch.ones_like(ids.reshape(-1)))
        ids, slots = self.slots.route(ids), self.slots.num_physical  # [T, K] physical slots
        if self.weight_before_down:
            dispatched = self.comm.dispatch(x, ids, slots, weights)
            kwargs["row_scales"] = dispatched.row_weights
            weights = torch.ones_like(weights)  # applied already: combine only sums
        else:
            dispatched = self.comm.dispatch(x, ids, slots)
        self.expert_rows += dispatched.hidden.shape[0]
        expert_out = self.ops.expert_ffn(dispatched.hidden, dispatched.tokens_per_expert, self.w13, self.w2, **kwargs)
        out = self.comm.combine(expert_out, dispatched, weights)  # [T, D]
        return out if self.shared is None else out + self.shared(x)


class MLAttention:
    """Multi-head latent attention in weight-absorbed form over a paged cache of latents [C + R].

    The cache holds one entry per token: the normalised compressed KV c [C] and the rotated shared
    key k_pe [R]. Queries are absorbed into latent space (q_nope @ W_UK), attention runs over the
    latents, and the result leaves latent space through W_UV.
    """

    def __init__(
        self,
        backend: ResolvedBackend,
        config: DeepseekConfig,
        w: Weights,
        prefix: str,
        rope: tuple[torch.Tensor, torch.Tensor],
        scale: float,
    ) -> None:
        self.ops, self.attention, self.layout = backend.ops, backend.attention, backend.kv_layout
        self.config, self.cos, self.sin, self.scale = config, rope[0], rope[1], scale
        self.w = {k.removeprefix(prefix + "."): v for k, v in w.items() if k.startswith(prefix + ".")}
        heads, nope, v = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
        kv_b = self.w["kv_b_proj.weight"].view(heads, nope + v, config.kv_lora_rank)  # [H, nope + v, C]
        self.w_uk = kv_b[:, :nope, :].transpose(1, 2).contiguous()  # [H, C, nope]: q_nope -> latent
        self.w_uv = kv_b[:, nope:, :].contiguous()  # [H, v, C]: latent -> value

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        w, ops = self.w, self.ops
        if self.config.q_lora_rank is None:
            q = ops.linear(x, w["q_proj.weight"])
        else:
            q_latent = ops.linear(x, w["q_a_proj.weight"], w.get("q_a_proj.bias"))
            q = ops.linear(
                ops.rms_norm(q_latent, w["q_a_layernorm.weight"], self.config.rms_norm_eps), w["q_b_proj.weight"]
            )
        return q.view(x.shape[0], self.config.num_attention_heads, self.config.qk_head_dim)  # [T, H, nope + R]

    def __call__(
        self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, cache: torch.Tensor, spec: CacheSpec
    ) -> torch.Tensor:
        cfg, ops, w = self.config, self.ops, self.w
        interleaved = cfg.rope_interleave
        q = self._queries(x)
        q_nope, q_pe = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim :]
        kv = ops.linear(x, w["kv_a_proj_with_mqa.weight"], w.get("kv_a_proj_with_mqa.bias"))  # [T, C + R]
        latent = ops.rms_norm(kv[:, : cfg.kv_lora_rank], w["kv_a_layernorm.weight"], cfg.rms_norm_eps)  # [T, C]
        k_pe = ops.rotary(kv[:, None, cfg.kv_lora_rank :], positions, self.cos, self.sin, interleaved=interleaved)
        self.layout.write(cache, spec, meta.slot_mapping, torch.cat([latent[:, None, :], k_pe], dim=-1))
        q_pe = ops.rotary(q_pe, positions, self.cos, self.sin, interleaved=interleaved)  # [T, H, R]
        q_latent = torch.cat([ops.head_linear(q_nope, self.w_uk), q_pe], dim=-1)  # [T, H, C + R]
        out = self.attention.paged_attention(
            q_latent, cache, spec, meta, scale=self.scale, value_dim=cfg.kv_lora_rank
        )  # [T, H, C]
        out = ops.head_linear(out, self.w_uv).reshape(x.shape[0], -1)  # [T, H * v]
        return ops.linear(out, w["o_proj.weight"], w.get("o_proj.bias"))


def moe_layers(model) -> list[MoE]:
    """The MoE layers of a model whose `layers` are tuples of its parts, in the order a forward runs them."""
    return [part for layer in model.layers for part in layer if isinstance(part, MoE)]
