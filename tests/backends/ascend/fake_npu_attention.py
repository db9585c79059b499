# ruff: noqa: E501  (each op's docstring opens with its torch_npu schema line, verbatim)
"""Part of the documentation-based fake torch_npu (fake_torch_npu.py): the paged attention op npu_fused_infer_attention_score."""

from __future__ import annotations

import torch
from fake_npu_common import FLOATS, HALVES, MASK_SIZE, DocViolation, _require, _unsupported_by_fake


def npu_fused_infer_attention_score(
    self,
    query,
    key,
    value,
    *,
    pse_shift=None,
    atten_mask=None,
    actual_seq_lengths=None,
    actual_seq_lengths_kv=None,
    dequant_scale1=None,
    quant_scale1=None,
    dequant_scale2=None,
    quant_scale2=None,
    quant_offset2=None,
    antiquant_scale=None,
    antiquant_offset=None,
    key_antiquant_scale=None,
    key_antiquant_offset=None,
    value_antiquant_scale=None,
    value_antiquant_offset=None,
    block_table=None,
    query_padding_size=None,
    kv_padding_size=None,
    key_shared_prefix=None,
    value_shared_prefix=None,
    actual_shared_prefix_len=None,
    query_rope=None,
    key_rope=None,
    key_rope_antiquant_scale=None,
    num_heads=1,
    scale=1.0,
    pre_tokens=2147483647,
    next_tokens=2147483647,
    input_layout="BSH",
    num_key_value_heads=0,
    sparse_mode=0,
    inner_precise=0,
    block_size=0,
    antiquant_mode=0,
    key_antiquant_mode=0,
    value_antiquant_mode=0,
    softmax_lse_flag=False,
):
    """npu_fused_infer_attention_score(Tensor query, Tensor key, Tensor value, *, Tensor? pse_shift=None, Tensor? atten_mask=None, SymInt[]? actual_seq_lengths=None, SymInt[]? actual_seq_lengths_kv=None, Tensor? dequant_scale1=None, Tensor? quant_scale1=None, Tensor? dequant_scale2=None, Tensor? quant_scale2=None, Tensor? quant_offset2=None, Tensor? antiquant_scale=None, Tensor? antiquant_offset=None, Tensor? key_antiquant_scale=None, Tensor? key_antiquant_offset=None, Tensor? value_antiquant_scale=None, Tensor? value_antiquant_offset=None, Tensor? block_table=None, Tensor? query_padding_size=None, Tensor? kv_padding_size=None, Tensor? key_shared_prefix=None, Tensor? value_shared_prefix=None, SymInt[]? actual_shared_prefix_len=None, Tensor? query_rope=None, Tensor? key_rope=None, Tensor? key_rope_antiquant_scale=None, int num_heads=1, float scale=1.0, int pre_tokens=2147483647, int next_tokens=2147483647, str input_layout="BSH", int num_key_value_heads=0, int sparse_mode=0, int inner_precise=0, int block_size=0, int antiquant_mode=0, int key_antiquant_mode=0, int value_antiquant_mode=0, bool softmax_lse_flag=False) -> (Tensor, Tensor)

    Implemented: input_layout "TND" with PageAttention (block_table), no quantization, pse, padding or
    prefix. query [T, N, D]; key/value [num_blocks, block_size, KV_N * D] (BnBsH) with identical
    shapes ([PTA] "key、value中对应tensor的shape需要完全一致"), contiguous, query's dtype; batch b owns
    query rows actual_seq_lengths[b-1]:actual_seq_lengths[b] (cumulative, last == T [OPS V5]) and
    attends to its first actual_seq_lengths_kv[b] cache positions (per batch under PageAttention),
    found through block_table[b] (int32). MLA: query_rope [T, N, Dr] and key_rope [blocks, bs, KV_N * Dr]
    come together and add q_rope . k_rope to the scores. Head h reads KV head h // (N / KV_N).
    sparse_mode 0: no mask allowed, no causal masking; sparse_mode 3 (rightDownCausal): atten_mask
    must be the 2048 x 2048 (or 1x / 1x1x) bool/int8/uint8 mask with 1 = masked ([OPS V5]), i.e.
    triu(ones, 1) (ASSUMPTION: the fake requires exactly that matrix); query i of Q attends to
    positions <= kv_len - Q + i. ASSUMPTION: sparse_mode 3 with kv_len < q_len is rejected (rows
    would see nothing). Returns (attention_out [T, N, D_v] in query's dtype, softmax_lse [T, N, 1]
    float32 when softmax_lse_flag else a [1] zero tensor).
    Block ids past a batch's last needed block are not read (the -1 padding is fine); the op itself
    does not validate block ids ([PTA] "不会对blockid的合法性进行校验"), the fake does.
    """
    op = "npu_fused_infer_attention_score"
    self._record(op, locals())
    unsupported = dict(
        pse_shift=pse_shift, dequant_scale1=dequant_scale1, quant_scale1=quant_scale1,
        dequant_scale2=dequant_scale2, quant_scale2=quant_scale2, quant_offset2=quant_offset2,
        antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset,
        key_antiquant_scale=key_antiquant_scale, key_antiquant_offset=key_antiquant_offset,
        value_antiquant_scale=value_antiquant_scale, value_antiquant_offset=value_antiquant_offset,
        query_padding_size=query_padding_size, kv_padding_size=kv_padding_size,
        key_shared_prefix=key_shared_prefix, value_shared_prefix=value_shared_prefix,
        actual_shared_prefix_len=actual_shared_prefix_len, key_rope_antiquant_scale=key_rope_antiquant_scale,
    )  # fmt: skip
    for name, v in unsupported.items():
        if v is not None:
            raise _unsupported_by_fake(op, name)
    if antiquant_mode or key_antiquant_mode or value_antiquant_mode:
        raise _unsupported_by_fake(op, "antiquant modes")
    if input_layout != "TND":
        raise _unsupported_by_fake(op, f"input_layout {input_layout!r} (only TND is)")
    if block_table is None:
        raise _unsupported_by_fake(op, "TND without PageAttention")
    _require(inner_precise in (0, 1, 2, 3), op, f"inner_precise must be 0-3, got {inner_precise}")

    # dtypes and contiguity ("不支持非连续的Tensor" for query, key, value, query_rope, key_rope)
    allowed = FLOATS if self.allow_float32_attention and self.profile is None else HALVES
    _require(query.dtype in allowed, op, f"query dtype {query.dtype} is not float16/bfloat16")
    for name, t in (("key", key), ("value", value)):
        _require(t.dtype == query.dtype, op, f"{name} dtype {t.dtype} differs from query's {query.dtype}")
    _require((query_rope is None) == (key_rope is None), op, "query_rope and key_rope go together")
    tensors = {"query": query, "key": key, "value": value, "query_rope": query_rope, "key_rope": key_rope}
    for name, t in tensors.items():
        if t is not None:
            _require(t.is_contiguous(), op, f"{name} must be contiguous")
    if query_rope is not None:
        _require(
            query_rope.dtype == query.dtype and key_rope.dtype == key.dtype, op, "rope dtypes must match query/key"
        )

    # shapes
    _require(query.dim() == 3, op, f"TND query must be 3-D, got {tuple(query.shape)}")
    tokens, heads, head_dim = query.shape
    _require(num_heads == heads, op, f"num_heads {num_heads} differs from query's N {heads}")
    kv_heads = num_key_value_heads or num_heads
    _require(heads % kv_heads == 0, op, f"num_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    _require(heads // kv_heads <= 64 or self.profile == "ascend950", op, "num_heads / num_key_value_heads > 64")
    if key.dim() == 4:
        raise _unsupported_by_fake(op, "the (blocknum, KV_N, blocksize, D) cache layout")
    _require(key.dim() == 3, op, f"paged key must be [blocknum, blocksize, H], got {tuple(key.shape)}")
    _require(key.shape == value.shape, op, f"key {tuple(key.shape)} and value {tuple(value.shape)} shapes differ")
    num_blocks, page, kv_width = key.shape
    _require(block_size > 0 and block_size == page, op, f"block_size {block_size} differs from key's {page}")
    _require(kv_width == kv_heads * head_dim, op, f"key H {kv_width} != num_key_value_heads {kv_heads} x D {head_dim}")
    value_dim = value.shape[2] // kv_heads
    rope_dim = 0
    if query_rope is not None:
        rope_dim = query_rope.shape[-1]
        _require(query_rope.shape == (tokens, heads, rope_dim), op, f"query_rope must be [{tokens}, {heads}, Dr]")
        _require(
            key_rope.shape == (num_blocks, page, kv_heads * rope_dim),
            op,
            "key_rope must be [blocknum, blocksize, KV_N * Dr]",
        )

    # lengths and the block table
    _require(actual_seq_lengths is not None, op, "TND needs actual_seq_lengths")
    _require(actual_seq_lengths_kv is not None, op, "PageAttention needs actual_seq_lengths_kv")
    ends = [int(v) for v in actual_seq_lengths]
    kv_lens = [int(v) for v in actual_seq_lengths_kv]
    batch = len(ends)
    _require(batch > 0 and len(kv_lens) == batch, op, f"{batch} query lengths but {len(kv_lens)} kv lengths")
    _require(
        all(v >= 0 for v in ends) and ends == sorted(ends), op, f"actual_seq_lengths {ends} must be non-decreasing"
    )
    _require(ends[-1] == tokens, op, f"the last actual_seq_lengths {ends[-1]} must equal T = {tokens}")
    q_lens = [b - a for a, b in zip([0] + ends[:-1], ends)]
    _require(block_table.dtype == torch.int32, op, f"block_table must be int32, got {block_table.dtype}")
    _require(block_table.dim() == 2 and block_table.shape[0] == batch, op, f"block_table must be [{batch}, max_blocks]")
    needed = [-(-n // page) for n in kv_lens]
    _require(all(n >= 0 for n in kv_lens), op, "negative kv length")
    _require(block_table.shape[1] >= max(needed), op, "block_table has fewer columns than the longest context needs")
    _require(num_blocks >= sum(needed), op, "fewer cache blocks than the contexts need")

    # masks
    if sparse_mode == 0:
        _require(atten_mask is None, op, "TND supports sparse_mode 0 only without atten_mask")
    elif sparse_mode == 3:
        _require(atten_mask is not None, op, "sparse_mode 3 needs the 2048 x 2048 atten_mask")
        _require(atten_mask.dtype in (torch.bool, torch.int8, torch.uint8), op, "atten_mask must be bool/int8/uint8")
        _require(
            tuple(atten_mask.shape) in ((MASK_SIZE,) * 2, (1,) + (MASK_SIZE,) * 2, (1, 1) + (MASK_SIZE,) * 2),
            op,
            f"sparse_mode 3 takes a (1, 1,) 2048 x 2048 mask, got {tuple(atten_mask.shape)}",
        )
        expected = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=atten_mask.device), 1)
        _require(
            torch.equal(atten_mask.reshape(MASK_SIZE, MASK_SIZE).bool(), expected),
            op,
            "the mask must be triu(ones, 1)",
        )
        for b in range(batch):
            _require(
                kv_lens[b] >= q_lens[b],
                op,
                f"batch {b}: kv length {kv_lens[b]} < query length {q_lens[b]} (ASSUMPTION)",
            )
    elif sparse_mode in (1, 2, 4):
        raise DocViolation(f"{op}: TND supports sparse_mode 0 (no mask) or 3 (with mask), got {sparse_mode}")
    else:
        raise DocViolation(f"{op}: sparse_mode {sparse_mode} is not supported")

    if self.profile is not None:
        _fia_profile_limits(
            self,
            op,
            head_dim,
            value_dim,
            rope_dim,
            heads,
            kv_heads,
            q_lens,
            page,
            sparse_mode,
            softmax_lse_flag,
            query.dtype,
        )

    # the computation
    group = heads // kv_heads
    out = torch.zeros(tokens, heads, value_dim, dtype=torch.float32)
    lse = torch.zeros(tokens, heads, 1, dtype=torch.float32)
    k_rows = key.view(num_blocks * page, kv_heads, head_dim)
    v_rows = value.view(num_blocks * page, kv_heads, value_dim)
    kr_rows = None if key_rope is None else key_rope.view(num_blocks * page, kv_heads, rope_dim)
    start = 0
    for b in range(batch):
        q_len, kv_len = q_lens[b], kv_lens[b]
        if q_len == 0:
            continue
        blocks = block_table[b, : needed[b]].long()
        _require(
            bool(((blocks >= 0) & (blocks < num_blocks)).all()),
            op,
            f"batch {b}: block ids {blocks.tolist()} out of range",
        )
        slots = (blocks[:, None] * page + torch.arange(page)).reshape(-1)[:kv_len]
        keys = k_rows[slots].float().repeat_interleave(group, dim=1)  # [S, N, D]
        values = v_rows[slots].float().repeat_interleave(group, dim=1)
        q = query[start : start + q_len].float()
        scores = torch.einsum("qnd,snd->nqs", q, keys)
        if kr_rows is not None:
            key_pe = kr_rows[slots].float().repeat_interleave(group, dim=1)
            scores = scores + torch.einsum("qnd,snd->nqs", query_rope[start : start + q_len].float(), key_pe)
        scores = scores * scale
        if sparse_mode == 3:
            last_visible = kv_len - q_len + torch.arange(q_len)  # right-down aligned
            scores = scores.masked_fill(torch.arange(kv_len)[None, :] > last_visible[:, None], float("-inf"))
        out[start : start + q_len] = torch.einsum("nqs,snd->qnd", scores.softmax(dim=-1), values)
        lse[start : start + q_len] = scores.logsumexp(dim=-1).transpose(0, 1)[..., None]
        start += q_len
    softmax_lse = lse if softmax_lse_flag else torch.zeros(1, dtype=torch.float32)
    return out.to(query.dtype), softmax_lse


def _fia_profile_limits(self, op, d, dv, dr, heads, kv_heads, q_lens, page, sparse_mode, lse_flag, dtype):
    max_q = max(q_lens)
    if self.profile == "ascend950":  # [OPS] aclnnFusedInferAttentionScoreV5.md
        _require(d <= 512, op, f"D must be <= 512, got {d}")
        if dr:
            _require(dr == 64, op, f"query_rope/key_rope D must be 64, got {dr}")
            _require(d in (128, 512), op, f"with rope, query D must be 128 or 512, got {d}")
            if d == 512:  # "Decode MLA"
                _require(kv_heads == 1, op, "Decode MLA needs num_key_value_heads 1")
                _require(sparse_mode in (0, 3, 4), op, f"Decode MLA supports sparse_mode 0/3/4, got {sparse_mode}")
            _require(page % 16 == 0 and page <= 1024, op, f"MLA block_size must be 16-aligned and <= 1024, got {page}")
        elif d in (64, 128) and dv in (64, 128):
            _require(page % 16 == 0 and page <= 1024, op, f"block_size must be 16-aligned and <= 1024, got {page}")
        elif max_q > 1:
            _require(page % 128 == 0 and page <= 1024, op, f"block_size must be 128-aligned and <= 1024, got {page}")
        else:
            _require(page % 16 == 0 and page <= 512, op, f"block_size must be 16-aligned and <= 512, got {page}")
        _require(kv_heads * d <= 65535, op, "BnBsH caches with KV_N * D > 65535 are rejected")
        return
    # "atlas_a2_a3": [PTA] torch_npu-npu_fused_infer_attention_score.md (the v1 API's own doc)
    _require(len(q_lens) <= 65536, op, "B must be <= 65536")
    if dr:
        _require(d in (128, 512), op, f"with query_rope, query D must be 512 or 128, got {d}")
        _require(d == 512, op, "TND with query D 128 and rope does not support PageAttention")
        _require(heads in (32, 64, 128), op, f"MLA (D 512) needs num_heads 32/64/128, got {heads}")
        _require(kv_heads == 1 and dr == 64, op, "MLA (D 512) needs num_key_value_heads 1 and rope D 64")
        _require(all(q <= 16 for q in q_lens), op, f"MLA (D 512) takes 1-16 query tokens per batch, got {max_q}")
        _require(page in (16, 128), op, f"MLA (D 512) block_size must be 16 or 128, got {page}")
        _require(not lse_flag, op, "MLA (D 512) does not output softmax_lse")
        if max_q == 1:
            _require(sparse_mode == 0, op, "MLA (D 512) with Q_S 1 supports only sparse_mode 0 without a mask")
        else:
            _require(sparse_mode == 3, op, "MLA (D 512) with Q_S > 1 supports only sparse_mode 3 with the mask")
    else:
        _require(d != 512, op, "TND with query D 512 needs query_rope and key_rope")
        _require(False, op, "TND without rope (D != 512) does not support PageAttention")
    _require(dtype in HALVES, op, "float16/bfloat16 only")
