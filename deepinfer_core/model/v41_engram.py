"""DeepSeek-V4.1 Engram: an n-gram lookup written into the residual streams (docs/deepseek_v41_reference.md §5).

Each position is hashed with the `max_ngram_size - 1` tokens before it (compressed ids: tokens that
normalise alike share one), once per step for every engram layer: for each n-gram order and head, a
rolling XOR of id x multiplier modulo its own prime bucket. The rows those hashes address are projected
into one key per stream and a shared value; the backend's `engram_gate` mixes the value into each stream.
Hashes depend on token ids alone, so the look-back of a sequence (its last max_ngram_size - 1 compressed
ids) is per-sequence state: `ENGRAM_STATE` on the first engram layer's caches.

The tables are plain row gathers, and the released ones (~203 GB as FP8 with scales) outgrow any device:
`EngramTables` keeps them on the device or in host memory (`--engram-placement`). On the host, a step's
rows are gathered there, all engram layers at once, and reach the device in one copy from pinned memory.
That waits for the step's hashes; prefetching the next step's rows while this one runs (its token ids are
known early only under async scheduling) is future work.
"""

from __future__ import annotations

import logging

import torch

from deepinfer_core.backend.resolve import ResolvedBackend
from deepinfer_core.backend.types import DeviceFacts
from deepinfer_core.backend.weight_formats import BlockFP8, weight_bytes
from deepinfer_core.engine.transfer import host_staging
from deepinfer_core.errors import DeepInferError
from deepinfer_core.kv.layout import CacheKind, CacheSpec
from deepinfer_core.model import engram_vocab
from deepinfer_core.model.config_v41 import DeepseekV41Config
from deepinfer_core.model.v4_attention import ROLLBACK_SLOTS
from deepinfer_core.model.v4_step import V4Step

__all__ = [
    "AUTO_HOST_SHARE",
    "ENGRAM_PLACEMENTS",
    "ENGRAM_STATE",
    "EngramLayer",
    "EngramTables",
    "NgramHasher",
    "check_engram_placement",
    "engram_placement",
]

log = logging.getLogger(__name__)

ENGRAM_STATE = "engram_history"
ENGRAM_PLACEMENTS = ("auto", "host", "device")  # --engram-placement
# auto keeps the tables on the device up to this share of its memory. Below it they cost the KV cache
# little and save the per-step host round trip; above it they take what the KV cache and the other
# weights need, while on the host they cost one copy of 48 rows per token (24 KiB at the released
# head_dim 256 in bfloat16). The released tables (~203 GB) exceed every device's share.
AUTO_HOST_SHARE = 0.1
_DEAD = -1  # no token: before the sequence start


def check_engram_placement(value: object) -> str:
    """`value` if it is one of ENGRAM_PLACEMENTS; else a DeepInferError saying what it may be."""
    if value not in ENGRAM_PLACEMENTS:
        raise DeepInferError(
            f"engram_placement must be one of {', '.join(ENGRAM_PLACEMENTS)} (--engram-placement: where "
            f"DeepSeek-V4.1's Engram tables live), got {value!r}"
        )
    return value


def engram_placement(requested: str, table_bytes: int, device: DeviceFacts) -> str:
    """Where tables of `table_bytes` live, "host" or "device". auto: the device where it is the host's own
    memory (a cpu backend) or where the tables take at most AUTO_HOST_SHARE of its memory; else the host."""
    if check_engram_placement(requested) != "auto":
        return requested
    if torch.device(device.torch_device).type == "cpu":
        return "device"
    return "device" if table_bytes <= AUTO_HOST_SHARE * device.total_memory_bytes else "host"


class NgramHasher:
    """Hash ids [T, engram layers, (max_ngram_size - 1) x heads] of a step's tokens, rows of each layer's table."""

    def __init__(self, backend: ResolvedBackend, cfg: DeepseekV41Config, token_map: list[int]) -> None:
        device = backend.torch_device
        self.layout = backend.kv_layout
        self.lookback = cfg.engram_max_ngram_size - 1
        # the state keeps the ids of a sequence's last lookback + 1 positions (one more than the hashes read):
        # a step writes its newest id where no shift of the same step reads, so running a decode step again
        # (a device graph's warm-up before capture) reads what the first run read
        self.span = self.lookback + 1
        self.rows = self.span + ROLLBACK_SLOTS  # and the rows a verify step's rejected drafts may overwrite
        self.token_map = torch.tensor(token_map, dtype=torch.int64, device=device)
        self.pad_id = token_map[cfg.engram_pad_id]
        primes = cfg.engram_primes()  # [layers][order - 2][head]
        self.primes = torch.tensor(primes, dtype=torch.int64, device=device)  # [L, orders, heads]
        offsets = [engram_vocab.engram_offsets(layer) for layer in primes]
        self.offsets = torch.tensor(offsets, dtype=torch.int64, device=device)  # [L, orders x heads]
        multipliers = engram_vocab.hash_multipliers(
            list(cfg.engram_layer_ids), cfg.engram_max_ngram_size, cfg.engram_compressed_vocab_size
        )
        self.multipliers = torch.tensor(multipliers, dtype=torch.int64, device=device)  # [L, max_ngram_size]
        # compressed ids stored exactly in float32 (compressed vocabularies are far below 2**24)
        self.state_spec = CacheSpec(CacheKind.SEQUENCE_STATE, torch.float32, state_shape=(self.rows,))

    def _lookback_sources(self, step: V4Step) -> tuple[torch.Tensor, torch.Tensor]:
        """For each token row and shift s = 0 (the token itself) .. lookback, the row of [B x rows state
        entries, then the step's T tokens] holding the id at position - s (-1: none, before the sequence start
        or before the state was written: a prefix hit's replay, whose first tokens the replay length covers),
        and the state writes (state entry, token row) that keep each sequence's last `rows` ids."""
        span, rows, sources, writes = self.span, self.rows, [], []
        if step.decode and step.queries <= rows:  # else a sequence's tokens share state rows: planned on the host
            return self._decode_lookback_sources(step)
        current = len(step._ends) * rows
        written = step.meta.window_starts.tolist()  # state entries of earlier positions are stale
        for b, row, first, end in step._sequences():
            since = max(0, written[b])
            for p in range(first, end):
                for s in range(span):
                    q = p - s
                    in_state = b * rows + q % rows if q >= since else -1
                    sources.append(current + row + q - first if q >= first else in_state)
            writes += [(b * rows + p % rows, row + p - first) for p in range(max(first, end - rows), end)]
        entries, tokens = zip(*writes) if writes else ((), ())
        device = step.device
        return (
            torch.tensor(sources, dtype=torch.int64, device=device).view(-1, span),
            torch.tensor([entries, tokens], dtype=torch.int64, device=device).view(2, -1),
        )

    def _decode_lookback_sources(self, step: V4Step) -> tuple[torch.Tensor, torch.Tensor]:
        """The same for a uniform step (row r: token j of sequence b's q newest), on the device."""
        span, rows, batch = self.span, self.rows, step.meta.num_seqs
        r, b, j, p = (t[:, None] for t in step._token_rows())
        shift = torch.arange(span, device=step.device)
        at = p - shift  # [T, span]: the positions of shifts 0 .. lookback
        since = step.meta.window_starts[b].clamp_min(0)
        sources = torch.where(at >= since, b * rows + at % rows, -1)
        sources = torch.where(shift <= j, batch * rows + r - shift, sources)  # positions in the step: its rows
        return sources, torch.cat([b * rows + p % rows, r], dim=1).T

    def __call__(self, token_ids: torch.Tensor, step: V4Step, state: torch.Tensor) -> torch.Tensor:
        compressed = self.token_map[token_ids]  # [T]
        history = self.layout.gather(state, self.state_spec, step.seq_slots).long()  # [B, rows]
        sources, (entries, rows) = self._lookback_sources(step)
        table = torch.cat([history.flatten(), compressed, compressed.new_full((1,), _DEAD)])
        ids = table[sources]  # [T, span]; source -1 picks the trailing DEAD
        blocked = (ids == _DEAD).cummax(dim=1).values  # once a shift is blocked, every longer one is
        ids = torch.where(blocked, self.pad_id, ids)
        flat = history.flatten()
        flat[entries] = compressed[rows]
        self.layout.write(state, self.state_spec, step.seq_slots, flat.view_as(history).float())
        products = ids[:, None, :] * self.multipliers[None]  # [T, L, max_ngram_size]
        rolling, hashes = products[..., 0], []
        for order in range(1, self.lookback + 1):
            rolling = torch.bitwise_xor(rolling, products[..., order])
            hashes.append(rolling[..., None] % self.primes[None, :, order - 1])  # [T, L, heads]
        return torch.cat(hashes, dim=-1) + self.offsets[None]  # [T, L, orders x heads]


class EngramTables:
    """Every engram layer's table, on the device or in host memory; gathers the rows a step's hashes address.

    A table is dense [rows, engram_head_dim], or FP8 as released (ops.BlockFP8 with one E8M0 scale per 32
    channels of a row: half the bytes of bf16), kept so: only the gathered rows are dequantized, to `dtype`,
    exactly as dequantizing the whole table at load would give them."""

    def __init__(self, tables: list, device: torch.device, on_host: bool, dtype: torch.dtype) -> None:
        self.tables = tables  # per engram layer [rows, engram_head_dim], host tensors when on_host
        self.device, self.on_host, self.dtype = device, on_host, dtype

    @classmethod
    def place(cls, tables: list, requested: str, backend: ResolvedBackend) -> EngramTables:
        """The loaded host `tables` where `requested` (one of ENGRAM_PLACEMENTS) puts them on `backend`."""
        table_bytes = sum(weight_bytes(tables).values())
        where = engram_placement(requested, table_bytes, backend.device)
        log.info("engram tables (%.2f GiB): %s memory (engram_placement %s)", table_bytes / (1 << 30), where, requested)
        device = backend.torch_device
        on_host = where == "host"
        return cls(tables if on_host else [t.to(device) for t in tables], device, on_host, backend.dtype)

    def gather(self, hash_ids: torch.Tensor) -> list[torch.Tensor] | torch.Tensor:
        """hash_ids [T, L, columns] -> per engram layer, its rows [T, columns x engram_head_dim] on the device."""
        if not self.on_host:
            return [_rows(table, hash_ids[:, k], self.dtype).flatten(1) for k, table in enumerate(self.tables)]
        ids = hash_ids.cpu()  # waits for the hashes (the future prefetch would not)
        tokens, layers, columns = ids.shape
        staged = [_stage(table, ids[:, k].flatten(), self.device) for k, table in enumerate(self.tables)]
        rows = [_rows(table, None, self.dtype) for table in staged]  # on the device, [T x columns, width]
        return torch.stack(rows).view(layers, tokens, -1)  # [L, T, columns x engram_head_dim]


def _rows(table, ids: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The table's rows `ids` (all of them for None) in `dtype`: FP8 rows dequantized, dense ones as they are."""
    if isinstance(table, BlockFP8):
        picked = table if ids is None else BlockFP8(table.weight[ids], table.scale[ids], table.block)
        return picked.dequantize(dtype)
    return (table if ids is None else table[ids]).to(dtype)


def _stage(table, ids: torch.Tensor, device: torch.device):
    """Host table rows `ids` copied to `device` through pinned staging buffers (FP8 tables: values and scales)."""

    def copy(values: torch.Tensor) -> torch.Tensor:
        raw = values.view(torch.uint8) if values.element_size() == 1 else values  # index_select on bytes
        staged = host_staging((ids.numel(), raw.shape[1]), raw.dtype, device)
        torch.index_select(raw, 0, ids, out=staged)
        return staged.to(device, non_blocking=True).view(values.dtype)

    if isinstance(table, BlockFP8):
        return BlockFP8(copy(table.weight), copy(table.scale), table.block)
    return copy(table)


class EngramLayer:
    """One engram layer: project its table rows and gate them into the streams."""

    def __init__(self, backend: ResolvedBackend, cfg: DeepseekV41Config, w: dict, prefix: str, index: int) -> None:
        self.ops, self.index, self.eps = backend.ops, index, cfg.rms_norm_eps
        self.hc_mult, self.hidden = cfg.hc_mult, cfg.hidden_size
        self.wkv = w[f"{prefix}.wkv.weight"]  # [(N + 1) D, columns x engram_head_dim]
        self.weight = w[f"{prefix}.q_weight"].float() * w[f"{prefix}.k_weight"].float()  # [N, D]

    def __call__(self, streams: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """rows [T, columns x engram_head_dim]: this layer's of EngramTables.gather."""
        kv = self.ops.linear(rows.to(self.wkv.dtype), self.wkv)  # [T, (N + 1) D]
        key = kv[:, : self.hc_mult * self.hidden].unflatten(1, (self.hc_mult, self.hidden))
        value = kv[:, self.hc_mult * self.hidden :]
        dead = torch.zeros(streams.shape[0], dtype=torch.bool, device=streams.device)  # text has no dead tokens
        return self.ops.engram_gate(streams, key, value, self.weight, dead, eps=self.eps)
