"""The ops only DeepSeek-V4 and V4.1 call, beside `Ops` and `AttentionOps`: their names and Protocols."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from deepinfer_core.kv.formats import BLOCK_FORMATS  # "<element>/<scale>:<block length>", defined there
from deepinfer_core.kv.layout import CacheSpec

if TYPE_CHECKING:  # ops imports this module for OP_NAMES and re-exports its names
    from deepinfer_core.backend.ops import AttentionMetadata

__all__ = [
    "BLOCK_FORMATS",
    "block_length",
    "check_layer_fn",
    "DSPARK_OPS",
    "V4_OPS",
    "V41_OPS",
    "V4AttentionOps",
    "V4Ops",
    "V41AttentionOps",
    "V41Ops",
]

# The ops (and op features) only DeepSeek-V4 calls; a backend without them lists them in `unsupported`.
V4_OPS = (
    "hc_pre",
    "hc_post",
    "softmax_pool",
    "swiglu_limit",
    "sqrtsoftplus_routing",
    "hash_routing",
    "sparse_attention",
    "indexer_topk",
)
# The ops DeepSeek-V4.1 adds (it also calls some of V4_OPS, sparse_attention among them); a backend without
# them lists them in `unsupported`.
V41_OPS = (
    "hc_mixes",
    "hc_collapse",
    "hc_expand",
    "round_to_format",
    "engram_gate",
    "indexer_select",
    "expert_row_scales",  # op feature of expert_ffn: the routing weight applied before w2
)
# What DeepSeek-V4.1's DSpark draft layers add; a backend without it cannot draft with DSpark.
DSPARK_OPS = ("block_attention",)


def block_length(fmt: str, x: torch.Tensor) -> int:
    """The block length of block format `fmt` for `round_to_format(x, fmt)`; ValueError (what to pass instead)
    for a format not in BLOCK_FORMATS or an x whose last dim the block does not divide."""
    if fmt not in BLOCK_FORMATS:
        raise ValueError(f"unknown block format {fmt!r}; round_to_format knows {', '.join(BLOCK_FORMATS)}")
    block = int(fmt.rsplit(":", 1)[1])
    if x.shape[-1] % block:
        raise ValueError(
            f"{fmt} rounds blocks of {block} along the last dim, which is {x.shape[-1]} here: "
            f"pass a tensor whose last dim is a multiple of {block}"
        )
    return block


def check_layer_fn(streams: torch.Tensor, fn: torch.Tensor) -> None:
    """hc_mixes' refusal of an fn that is not the layer form [(2 + N) N, N*D] for streams [T, N, D]."""
    n = streams.shape[1]
    if fn.shape[0] != (2 + n) * n:
        raise ValueError(
            f"hc_mixes takes the layer form fn [(2 + N) N, N*D] = [{(2 + n) * n}, {n * streams.shape[2]}] "
            f"for {n} streams; got fn {list(fn.shape)}"
        )


@runtime_checkable
class V4Ops(Protocol):
    """Ops only DeepSeek-V4 calls, on the object `deepinfer_backend_ops` returns (beside `Ops`). A backend
    without them lists them in `Capabilities.unsupported` (names in V4_OPS)."""

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
        """V4's hyper-connection weights and the collapse of its N residual streams [T, N, D], in float32.

        mixes = rms(streams.flatten(1)) @ fn^T (rms without weight, `norm_eps`); with fn [(2+N)N, N*D]
        the mixes split into pre [N] | post [N] | comb [N*N], scaled by scale[0..2] and offset by base:
        pre = sigmoid(.) + eps, post = 2 sigmoid(.), comb = softmax(., last dim) + eps, then Sinkhorn:
        comb /= column sums + eps, then (sinkhorn_iters - 1) times rows then columns likewise.
        Returns (collapsed [T, D] = sum_n pre_n streams_n in streams.dtype, post [T, N], comb [T, N, N]).
        With fn [N, N*D] (the head before the final norm) only pre exists: post and comb are None.
        """
        ...

    def hc_post(
        self, block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """New streams [T, N, D]: out_k = post_k * block_out [T, D] + sum_j comb[j, k] * streams_j.

        Rounded like transformers: post and comb to streams.dtype first, then each term, then the sum."""
        ...

    def softmax_pool(self, values: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """values, logits [N, S, D] -> [N, D] = sum over S of softmax_S(logits) * values, per channel,
        the softmax in float32 (V4's compressors pool each window's tokens like this). -inf logits
        take no part (a channel must have one finite logit); the weights are rounded to values.dtype
        before the weighted sum, which is in values.dtype."""
        ...


@runtime_checkable
class V4AttentionOps(Protocol):
    """Attention ops only DeepSeek-V4 calls, on the object `deepinfer_backend_attention` returns."""

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
        """DeepSeek-V4 attention: one shared key = value head, a sliding window plus compressed entries.

        q [T, H, D]; kv [T, D] this step's entries (normalised, roped); ring: the SLIDING_WINDOW cache
        (entries [1, D]) holding earlier positions of each sequence at `meta.seq_slots` (this step's are
        not in it yet). Query at position t sees window entries at positions t - window < s <= t (ring
        entries only from `meta.window_starts[b]` on: older ring slots are stale), and, when `compressed`
        (PAGED, `compressed_spec.compress_rate` m, entries [1, D]) is given, compressed entry w of its
        sequence iff w < (t + 1) // m — all of them (`indices` None) or only those also listed in `indices`
        [T, K] (entry numbers; -1 = none; a listed entry the query cannot see yet is not attended).
        logits = q.k * scale; a per-head sink logit `sinks` [H] joins the softmax and is dropped after
        it. Returns [T, H, D] in q.dtype, accumulated in float32.
        """
        ...

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
        """V4's lightning indexer: which compressed entries each query attends.

        q [T, Hi, Di]; weights [T, Hi] float32; keys: PAGED cache of compressed indexer keys (entries
        [1, Di], rate m = keys_spec.compress_rate). score[t, w] = sum_h weights[t, h] * relu(q[t, h] . k_w)
        * scale in float32, over the entries w < (t + 1) // m of t's sequence. Returns [T, top_k] int64:
        the min(top_k, visible) best w per query (any order), then -1. Equal scores (ReLU makes exact
        zeros common) go to the lower entry number, so the choice does not depend on how the prompt was
        chunked (transformers' torch.topk breaks such ties by its own rule).
        """
        ...


@runtime_checkable
class V41Ops(Protocol):
    """Ops only DeepSeek-V4.1 calls, on the object `deepinfer_backend_ops` returns (beside `Ops`). A backend
    without them lists them in `Capabilities.unsupported` (names in V41_OPS)."""

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
        """The hyper-connection weights of one site from its N entering streams [T, N, D], in float32.

        Exactly hc_pre's formulas with fn [(2 + N) N, N*D]: mixes = rms(streams.flatten(1)) @ fn^T (rms without
        weight, `norm_eps`), split into pre [N] | post [N] | comb [N*N], scaled by scale[0..2], offset by base;
        pre = sigmoid(.) + eps, post = 2 sigmoid(.), comb = softmax(., last dim) + eps, then Sinkhorn: comb /=
        column sums + eps, then (sinkhorn_iters - 1) times rows then columns likewise. Returns (pre [T, N],
        post [T, N], comb [T, N, N]), all float32. pre is not applied here: V4.1 collapses a later stream
        tensor with it (`hc_collapse`).
        """
        ...

    def hc_collapse(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """streams [T, N, D], pre [T, N] float32 -> [T, D] = sum_n pre_n * streams_n, computed in float32 and
        cast once to streams.dtype (bitwise hc_pre's collapse when pre is the same)."""
        ...

    def hc_expand(
        self, block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """New streams [T, N, D]: out_k = post_k * block_out [T, D] + sum_j comb[j, k] * streams_j, with
        post [T, N] and comb [T, N, N] float32. Everything in float32, ONE cast to streams.dtype at the end
        (unlike hc_post, which rounds post and comb to streams.dtype first)."""
        ...

    def round_to_format(self, x: torch.Tensor, fmt: str) -> torch.Tensor:
        """The value x takes when stored in block format `fmt` (one of BLOCK_FORMATS) along its last dim:
        V4.1's fake quantisation. Returns x's shape and dtype; every result is exact in bfloat16.

        Per block of the last dim (32 or 16 channels), in float32, amax = max |x| over the block:
        - "fp8_e4m3/pow2:32" (window KV): s = pow2ceil(max(amax, 1e-4) * (1/448)); q = clamp(x / s, -448,
          448) cast to float8_e4m3fn (round to nearest even) and back; result q * s.
        - "fp4_e2m1/pow2:32" (index keys and queries): s = pow2ceil(max(amax, 6 * 2^-126) * (1/6));
          q = e2m1(clamp(x / s, -6, 6)); result q * s.
        - "fp4_e2m1/e4m3:16" (compressed KV): s = float(float8_e4m3fn(max(amax, 6 * 2^-9) / 6)) (a division,
          rounded to e4m3 by the cast); q = e2m1(clamp(x / s, -6, 6)); result q * s.
        pow2ceil(t) = 2^(e - 127 + (m != 0)) for the exponent field e and mantissa field m of t's float32
        bits (2^ceil(log2 t) for normal t). e2m1 rounds |q| to the grid {0, .5, 1, 1.5, 2, 3, 4, 6} half to
        even, then applies q's sign (a zero is +0): the ties at 0.25, 1.25, 2.5 and 5 round down, those at
        0.75, 1.75 and 3.5 up. Raises ValueError for an unknown fmt or a last dim that is not a multiple of
        the block (the model calls it only when it is one).
        """
        ...

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
        """V4.1's engram injection: streams h [T, N, D] plus a per-stream gated share of value [T, D].

        key [T, N, D], weight [N, D] (the model's q_weight * k_weight), dead [T] bool (pad / image tokens).
        In float32: rstd[t, n] = rsqrt(mean_D(h^2) + eps) * rsqrt(mean_D(key^2) + eps); dot[t, n] =
        sum_D(h * weight * key) * rstd * D^-0.5; gate = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6))), 0 where
        dead; h' = h + gate * value. Returns h' [T, N, D] cast once to streams.dtype.
        """
        ...


@runtime_checkable
class V41AttentionOps(Protocol):
    """Attention ops only DeepSeek-V4.1 calls, on the object `deepinfer_backend_attention` returns."""

    def indexer_select(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        keys_spec: CacheSpec,
        meta: AttentionMetadata,
        *,
        top_k: int,
        scale: float,
        within: torch.Tensor | None = None,
        block_size: int = 1,
        top_blocks: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """V4.1's two-level indexer: which compressed entries each query attends, and optionally which blocks
        of entries later index layers may choose from.

        Scores exactly as indexer_topk: score[t, w] = sum_h weights[t, h] * relu(q[t, h] . k_w) * scale in
        float32 (q [T, Hi, Di], weights [T, Hi] float32, keys PAGED entries [1, Di] at rate m =
        keys_spec.compress_rate), over the visible entries w < (t + 1) // m of t's sequence. Block j is
        entries j * block_size .. (j + 1) * block_size - 1.

        within [T, B] int64 block ids (-1 = none), when given: only visible entries of the listed blocks
        are candidates (V4.1's re-scoring index layers, restricted by the candidate source's blocks).
        Returns (indices, blocks):
        - indices [T, top_k] int64: the min(top_k, candidates) best candidates (any order), then -1.
        - blocks [T, top_blocks] int64, or None when top_blocks is 0: the best blocks by the scores of ALL
          visible entries (`within` does not apply), block score = max of its visible entries' scores;
          the block of the newest visible entry, (visible - 1) // block_size, is always kept (ranked
          first); blocks without a visible entry never are; min(top_blocks, such blocks) of them (any
          order), then -1.

        Ties: equal scores go to the LOWER entry number, and equal block scores to the lower block number
        (a stable sort, descending), so the choice never depends on how the prompt was chunked. The
        reference and every backend follow this (transformers' torch.topk breaks ties by its own rule).
        """
        ...

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
        """A draft block's attention (DSpark): each sequence's step rows are one block that attends to itself
        in both directions and to the same window before it.

        q [T, H, D]; kv [T, D] the block's entries (normalised, roped), never written to the ring; ring: the
        SLIDING_WINDOW cache (entries [1, D]) of each sequence at `meta.seq_slots`. Sequence b's block is
        its rows query_start_loc[b] .. query_start_loc[b + 1] at positions first .. seq_lens[b] - 1; every
        one of its queries sees ring entries at positions max(first - window, window_starts[b], 0) .. first - 1
        (at most ring_spec.window of them) and all of the block's entries. `meta.max_query_len` is at least
        the longest block. logits = q.k * scale; a per-head sink logit `sinks` [H] joins the softmax and is
        dropped after it. Returns [T, H, D] in q.dtype, accumulated in float32; rows past
        query_start_loc[-1] (padding) hold any finite values.
        """
        ...
