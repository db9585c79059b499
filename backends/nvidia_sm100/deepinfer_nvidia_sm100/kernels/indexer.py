"""DeepSeek-V4's lightning indexer (indexer_topk) and V4.1's two-level one (indexer_select): a Triton kernel for
the scores, torch ops on the device for the choices; no host reads, nothing shaped by the batch's contents.

Scores: one program per query token and BLOCK_C compressed entry slots. C, the number of slots per query, is
a static bound, the block table's width in entries (never the longest sequence, which only the host could
read); slot c of the query's sequence holds a score iff the query sees entry c, c < (position + 1) // rate,
and -inf otherwise (a program whose slots are all past that reads nothing). The heads' q tile [BLOCK_H, Di]
times the entries' keys^T [Di, BLOCK_C], relu, times scale and the head weights, summed over the heads.

Choices: exactly the reference's stable descending sort (ties to the lower entry, or block), by a torch.topk
over int64 keys that cannot tie: the score's float32 bits made order-preserving in the high half, C - 1 - c
in the low half. A -0.0 score is stored as +0.0 first, so that the zeros ReLU makes tie as in a float sort.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from deepinfer_core.kv.layout import CacheSpec
from deepinfer_nvidia_sm100.kernels import packed
from deepinfer_nvidia_sm100.kernels._common import INTERPRET, dot_in_float32, mma, next_pow2
from deepinfer_nvidia_sm100.kernels.packed import format_code, load_rows, stage_blocks, staged_bytes
from deepinfer_nvidia_sm100.kernels.sparse_attention import token_metadata

__all__ = ["index_scores", "indexer_select", "indexer_topk"]

KEY_ROWS_ELEMENTS = 1 << 25  # the top-k's int64 keys (and topk's own buffers) of this many scores at a time


@triton.jit
def _index_scores_kernel(
    q_ptr, w_ptr, keys_ptr, tok_ptr, tables_ptr, scores_ptr, H, T, C, scale,
    sq_t, sq_h, sw_t, sw_h, skeys, st_b, ss_t,
    DI: tl.constexpr, BD: tl.constexpr, RATE: tl.constexpr, PER_BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, F32: tl.constexpr, KEY_FMT: tl.constexpr,
):  # fmt: skip
    t, c_block = tl.program_id(0), tl.program_id(1)
    seq = tl.load(tok_ptr + t)  # tok [4, T]: sequence, position, ...
    visible = (tl.load(tok_ptr + T + t) + 1) // RATE  # the query sees entries c < visible
    c = c_block * BLOCK_C + tl.arange(0, BLOCK_C)
    seen = c < visible
    scores = tl.full((BLOCK_C,), float("-inf"), dtype=tl.float32)
    if c_block * BLOCK_C < visible:  # else nothing to read: the block table past the sequence may be -1
        d = tl.arange(0, BD)
        in_d = d < DI
        block_id = tl.load(tables_ptr + seq.to(tl.int64) * st_b + c // PER_BLOCK, mask=seen, other=0)
        rows = block_id.to(tl.int64) * PER_BLOCK + c % PER_BLOCK
        keys = load_rows(keys_ptr, rows, skeys, seen, d, in_d, KEY_FMT, DI).to(q_ptr.dtype.element_ty)
        total = tl.zeros((BLOCK_C,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            heads = h0 + tl.arange(0, BLOCK_H)
            live = heads < H
            q_rows = q_ptr + t.to(tl.int64) * sq_t + heads[:, None] * sq_h
            q = tl.load(q_rows + d[None, :], mask=live[:, None] & in_d[None, :], other=0.0)  # [BLOCK_H, BD]
            dots = mma(q, tl.trans(keys), tl.zeros((BLOCK_H, BLOCK_C), dtype=tl.float32), F32)  # [BLOCK_H, BLOCK_C]
            gains = tl.load(w_ptr + t.to(tl.int64) * sw_t + heads * sw_h, mask=live, other=0.0).to(tl.float32)
            total += tl.sum(tl.maximum(dots, 0.0) * scale * gains[:, None], axis=0)
        total = tl.where(total == 0.0, 0.0, total)  # +0.0 for every zero, however the sums were rounded
        scores = tl.where(seen, total, float("-inf"))
    tl.store(scores_ptr + t.to(tl.int64) * ss_t + c, scores, mask=c < C)


def index_scores(
    q, weights, keys, keys_spec: CacheSpec, meta, kv_block_size: int, *, scale: float, stage: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hi, Di], weights [T, Hi], keys [rows, 1, Di] or packed [rows, bytes] (kernels.packed) (PAGED, row per
    slot; `kv_block_size` tokens per block) -> (scores [T, C] float32, -inf where the query does not see the
    entry; visible entries [T]).

    stage: packed keys decoded once into a scratch (kernels.packed.stage_blocks, True) or by every query that
    reads them (False); None: staged where the step averages two queries or more a sequence (a prefill's
    chunks), where each program decoding its own would repeat the work, and the scratch stays within
    kernels.packed.STAGE_MAX_BYTES. The same bits under the interpreter and in the H200 tests; the
    batch-invariant mode passes False all the same."""
    tokens, heads, dim = q.shape
    per_block = keys_spec.entries_per_block(kv_block_size)
    tables = meta.block_tables
    count = tables.shape[1] * per_block  # C: every entry the block table can hold, a bound known on the host
    scores = torch.empty((tokens, count), dtype=torch.float32, device=q.device)
    tok = token_metadata(meta, tokens)
    visible = (tok[1].long() + 1) // keys_spec.compress_rate  # [T]
    if tokens == 0 or count == 0:
        return scores, visible
    if q.stride(-1) != 1:
        q = q.contiguous()
    packed_keys = format_code(keys, keys_spec) != 0
    if packed_keys and stage is None:
        fits = staged_bytes(keys_spec, tables, per_block, q.dtype) <= packed.STAGE_MAX_BYTES
        stage = fits and 2 * tables.shape[0] <= tokens
    if packed_keys and stage:
        keys, tables = stage_blocks(keys, keys_spec, tables, per_block, q.dtype)
    block_d = max(16, next_pow2(dim))
    block_c = 32 if INTERPRET else 128
    launch = {} if INTERPRET else {"num_warps": 4}
    _index_scores_kernel[(tokens, triton.cdiv(count, block_c))](
        q, weights, keys, tok, tables, scores, heads, tokens, count, scale,
        q.stride(0), q.stride(1), weights.stride(0), weights.stride(1), keys.stride(0), tables.stride(0),
        scores.stride(0),
        DI=dim, BD=block_d, RATE=keys_spec.compress_rate, PER_BLOCK=per_block,
        BLOCK_H=min(max(16, next_pow2(heads)), 64), BLOCK_C=block_c, F32=dot_in_float32(q.dtype),
        KEY_FMT=format_code(keys, keys_spec), **launch,
    )  # fmt: skip
    return scores, visible


def _best_first(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[Q, N] float32 -> the k best column numbers of each row, best first; ties to the lower number (as a
    stable descending sort, for any scores without NaN and with +0.0 for every zero)."""
    bits = scores.view(torch.int32)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # int32 in the order of the floats
    columns = torch.arange(scores.shape[1], device=scores.device)
    keys = ordered.to(torch.int64) * 2**32 + (scores.shape[1] - 1 - columns)  # [Q, N], distinct per row
    return keys.topk(k, dim=1).indices


def _picked(scores: torch.Tensor, width: int) -> torch.Tensor:
    """scores [Q, N] -> [Q, width]: the best columns with a score above -inf, best first, then -1. Rows go
    KEY_ROWS_ELEMENTS // N at a time, so the int64 keys of a long prefill chunk stay bounded."""
    k = min(width, scores.shape[1])
    rows = max(1, KEY_ROWS_ELEMENTS // max(1, scores.shape[1]))
    picks = torch.cat([_best_first(chunk, k) for chunk in scores.split(rows)])  # [Q, k]
    picks = torch.where(scores.gather(1, picks) > float("-inf"), picks, -1)
    return F.pad(picks, (0, width - k), value=-1)


def indexer_topk(
    q, weights, keys, keys_spec: CacheSpec, meta, kv_block_size: int, *, top_k: int, scale: float,
    stage: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """V4's lightning indexer -> [T, top_k] int64: each query's best visible entries, best first, then -1.
    stage: as index_scores'."""
    scores, _ = index_scores(q, weights, keys, keys_spec, meta, kv_block_size, scale=scale, stage=stage)
    return _picked(scores, top_k)


def indexer_select(
    q, weights, keys, keys_spec: CacheSpec, meta, kv_block_size: int, *, top_k: int, scale: float,
    within: torch.Tensor | None = None, candidate_block: int = 1, top_blocks: int = 0, stage: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """V4.1's two-level indexer over candidate blocks of `candidate_block` entries (not the KV cache's blocks of
    `kv_block_size` tokens) -> (entries [T, top_k], blocks [T, top_blocks] or None when top_blocks is 0).

    blocks: by the max score of their visible entries, the newest visible entry's block first, then -1.
    entries: the best visible ones, only of the blocks in the query's row of `within` [T, B] (-1: none) if
    given, best first, then -1. stage: as index_scores'."""
    scores, visible = index_scores(q, weights, keys, keys_spec, meta, kv_block_size, scale=scale, stage=stage)
    tokens, count = scores.shape
    num_blocks = triton.cdiv(count, candidate_block)
    grouped = F.pad(scores, (0, num_blocks * candidate_block - count), value=float("-inf"))
    grouped = grouped.view(tokens, num_blocks, candidate_block)  # [T, NB, candidate_block]
    blocks = None
    if top_blocks:
        block_scores = grouped.amax(dim=-1)  # [T, NB]
        newest = torch.where(visible > 0, (visible - 1) // candidate_block, -1)  # -1: pins no block
        pinned = torch.arange(num_blocks, device=scores.device)[None, :] == newest[:, None]
        blocks = _picked(block_scores.masked_fill(pinned, float("inf")), top_blocks)
    if within is not None:
        listed = torch.zeros((tokens, num_blocks + 1), dtype=torch.bool, device=scores.device)  # + a "none" column
        real = (within >= 0) & (within < num_blocks)
        listed.scatter_(1, torch.where(real, within, num_blocks).long(), True)
        grouped = grouped.masked_fill(~listed[:, :num_blocks, None], float("-inf"))
        scores = grouped.flatten(1)[:, :count]
    return _picked(scores, top_k), blocks
