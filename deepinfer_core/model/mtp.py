"""DeepSeek-V3's multi-token prediction (MTP) module as a drafter for speculative decoding, and what every MTP
drafter shares (`ChainDrafter`: the catch-up and the chained drafts; DeepSeek-V4's layer is model/mtp_v4.py).

The checkpoint's layer `num_hidden_layers` (V3: 61) is one more decoder block with its own inputs and head:
at position p it reads the target model's final hidden state h_p (after the final norm) and the embedding of
the token at p + 1, each RMS-normed (`hnorm`, `enorm`), concatenated [embedding, hidden] and projected back
to the model width (`eh_proj`); the block (MLA + MoE, its own KV cache) then runs at position p, and
`shared_head` (norm + LM head) turns its output into logits for the token at p + 2. The embedding of
position 0 is zeroed (as vLLM does). Drafting k tokens reuses the block: step j reads its own previous output
as the hidden state and its previous draft as the token, one position further.

Every step the drafter first catches up over the step's positions (the target's hidden states and the next
tokens: known prompt tokens, or the tokens the step sampled), so its cache follows the target's; a verify
step's rejected positions hold garbage past the sequence's length, as the target's do, and are overwritten
by later steps. Then it drafts from the last accepted position, acceptance counted on the device. Drafts are
greedy (argmax). Its cache lives in the model's blocks, so the prefix cache shares it too; the entry at a
shared block's last position was computed with the token that followed it in the sequence that filled the
block, which a sequence sharing only the block may not have (its drafts there may be worse; its output is
the same, as with any draft).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from deepinfer_core.backend.ops import AttentionMetadata
from deepinfer_core.backend.resolve import ResolvedBackend
from deepinfer_core.model.config import DeepseekConfig
from deepinfer_core.model.layers import DenseMLP, MLAttention, MoE

__all__ = ["ChainDrafter", "DraftInputs", "MTPDrafter", "mtp_weight_shapes"]


def mtp_weight_shapes(cfg: DeepseekConfig, block_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The MTP layer's tensors: its own inputs and head, and `block_shapes` (a decoder layer's tensors named
    under model.layers.{num_hidden_layers}); the shared embedding is the model's."""
    d, p = cfg.hidden_size, f"model.layers.{cfg.num_hidden_layers}"
    return {
        f"{p}.enorm.weight": (d,),
        f"{p}.hnorm.weight": (d,),
        f"{p}.eh_proj.weight": (d, 2 * d),
        f"{p}.shared_head.norm.weight": (d,),
        f"{p}.shared_head.head.weight": (cfg.vocab_size, d),
        **block_shapes,
    }


class ChainDrafter:
    """What an MTP drafter does each step, whatever its block: run it over the step's positions (`forward`),
    then chain k drafts from each request's last accepted position. A subclass defines `forward(next_ids,
    positions, hidden, meta, caches)` -> its output rows and `draft_tokens(out)` -> greedy drafts, and
    `cache_specs` (its layers' caches, allocated after the model's: `caches` is that list)."""

    def target_forward(self, model, token_ids, positions, meta, caches) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the target model over a step -> (its final hidden states [T, D] for the logits, what this drafter
        reads of each position: here the same hidden states)."""
        hidden = model.forward(token_ids, positions, meta, caches)
        return hidden, hidden

    def draft(self, step: DraftInputs, caches: list[dict[str, torch.Tensor]], k: int) -> torch.Tensor:
        """Catch up over the step's positions, then draft k tokens per sampled request -> [R, k] int64."""
        out = self.forward(step.next_ids, step.positions, step.hidden, step.meta, caches)  # [T, ...]
        # the last accepted row of each request: its first row plus its accepted drafts
        last = step.last_token_index[step.first_row + step.accepted]  # [R] index in [T]
        hidden, position = out[last], step.positions[last]  # [R, ...], [R]
        drafts = [self.draft_tokens(hidden)]
        for _ in range(k - 1):  # each further draft: one more position, the previous output as the hidden state
            position = torch.minimum(position + 1, step.position_limit)
            hidden = self.forward(drafts[-1], position, hidden, _one_position(step, position), caches)
            drafts.append(self.draft_tokens(hidden))
        return torch.stack(drafts, dim=1)


def _one_position(step: DraftInputs, position: torch.Tensor) -> AttentionMetadata:
    """The metadata of one token per sampled request, at `position` [R], in the sequences of `step`."""
    meta, index, block = step.meta, step.seq_index, step.block_size
    tables = meta.block_tables[index]  # [R, max_blocks]
    rows = torch.arange(len(index), device=index.device)

    def per_sequence(values: torch.Tensor | None) -> torch.Tensor | None:  # rings and states (V4), if any
        return None if values is None else values[index]

    return AttentionMetadata(
        query_start_loc=torch.arange(len(index) + 1, device=index.device),
        seq_lens=position + 1,
        block_tables=tables,
        slot_mapping=tables[rows, position // block] * block + position % block,
        seq_slots=per_sequence(meta.seq_slots),
        window_starts=per_sequence(meta.window_starts),
        cached_lens=per_sequence(meta.cached_lens),
        max_query_len=1,
    )


class MTPDrafter(ChainDrafter):
    """Drafts tokens with a DeepSeek-V3 checkpoint's MTP layer; its KV cache is one more paged "kv" layer."""

    def __init__(self, model, weights: Mapping[str, torch.Tensor], backend: ResolvedBackend) -> None:
        cfg: DeepseekConfig = model.config
        device = backend.torch_device
        w = {name: t.to(device) for name, t in weights.items()}
        p = f"model.layers.{cfg.num_hidden_layers}"
        self.config, self.ops, self.embed = cfg, backend.ops, model.embed
        self.cache_spec = model.cache_spec
        self.cache_specs = [{"kv": model.cache_spec}]
        self.enorm, self.hnorm = w[f"{p}.enorm.weight"], w[f"{p}.hnorm.weight"]
        self.eh_proj = w[f"{p}.eh_proj.weight"]
        self.head_norm, self.head = w[f"{p}.shared_head.norm.weight"], w[f"{p}.shared_head.head.weight"]
        rope, scale = model.layers[0][1].cos, model.layers[0][1].scale
        self.attention = MLAttention(backend, cfg, w, f"{p}.self_attn", (rope, model.layers[0][1].sin), scale)
        if cfg.is_moe_layer(cfg.num_hidden_layers):
            self.mlp = MoE.from_weights(backend, cfg, w, f"{p}.mlp")
        else:
            self.mlp = DenseMLP.from_weights(backend, w, f"{p}.mlp")
        self.attn_norm, self.mlp_norm = w[f"{p}.input_layernorm.weight"], w[f"{p}.post_attention_layernorm.weight"]

    def forward(
        self,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        caches: list[dict[str, torch.Tensor]],
    ) -> torch.Tensor:
        """next_ids, positions [T], hidden [T, D] (the hidden state at each position) -> the block's output
        [T, D] (before shared_head's norm); writes the block's latents at meta.slot_mapping."""
        ops, eps = self.ops, self.config.rms_norm_eps
        embedded = self.embed[next_ids] * (positions != 0)[:, None].to(hidden.dtype)  # position 0: zeroed
        x = ops.linear(torch.cat([ops.rms_norm(embedded, self.enorm, eps), ops.rms_norm(hidden, self.hnorm, eps)], -1),
                       self.eh_proj)  # fmt: skip
        x = x + self.attention(ops.rms_norm(x, self.attn_norm, eps), positions, meta, caches[0]["kv"], self.cache_spec)
        return x + self.mlp(ops.rms_norm(x, self.mlp_norm, eps))

    def draft_tokens(self, out: torch.Tensor) -> torch.Tensor:
        """The block's outputs [N, D] -> greedy drafts [N]."""
        return self.ops.linear(self.ops.rms_norm(out, self.head_norm, self.config.rms_norm_eps), self.head).argmax(-1)


class DraftInputs:
    """What a drafter reads of one step, on the device. Rows: the step's sampled rows (a verify step has one per
    draft after the request's own); requests: the step's sampled requests, in order."""

    def __init__(
        self,
        next_ids: torch.Tensor,  # [T] the token after each position
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, ...] what the drafter reads of the target at each position (target_forward)
        meta: AttentionMetadata,
        last_token_index: torch.Tensor,  # [rows] index in [T] of each sampled row
        first_row: torch.Tensor,  # [R] each request's first row
        seq_index: torch.Tensor,  # [R] each request's sequence in meta
        accepted: torch.Tensor,  # [R] each request's accepted drafts
        position_limit: torch.Tensor,  # [R] the last position each request's blocks (and the model) hold
        block_size: int,
    ) -> None:
        self.next_ids, self.positions, self.hidden, self.meta = next_ids, positions, hidden, meta
        self.last_token_index, self.first_row, self.accepted = last_token_index, first_row, accepted
        self.seq_index = seq_index
        self.position_limit, self.block_size = position_limit, block_size
