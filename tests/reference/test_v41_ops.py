"""Reference DeepSeek-V4.1 ops (V41_OPS) against hand-computed values and independently written formulas
(python loops, float64): block-format rounding, the split hyper-connection ops, the engram gate, and the
two-level indexer with its tie rule."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer_core.backend.ops import BLOCK_FORMATS, AttentionMetadata, RoutingConfig, V41AttentionOps, V41Ops
from deepinfer_core.kv.layout import CacheKind, CacheSpec, compressed_slots
from deepinfer_core.reference.attention import ReferenceAttention
from deepinfer_core.reference.kv import ReferenceKVLayout
from deepinfer_core.reference.ops import ReferenceOps

OPS = ReferenceOps()
CPU = torch.device("cpu")
FP8, FP4, FP4_E4M3 = BLOCK_FORMATS  # "fp8_e4m3/pow2:32", "fp4_e2m1/pow2:32", "fp4_e2m1/e4m3:16"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _block(values: list[float], length: int) -> torch.Tensor:
    """One block [1, length] float32: `values`, then zeros."""
    return torch.tensor([values + [0.0] * (length - len(values))])


def test_reference_implements_the_v41_protocols():
    assert isinstance(OPS, V41Ops)
    assert isinstance(ReferenceAttention(ReferenceKVLayout(CPU)), V41AttentionOps)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy", "noaux_tc"])
def test_moe_route_ties_go_to_the_lower_expert_and_group(method):
    # V4's moe_route shares the contract's tie rule: eight experts in four groups of two; experts 1, 2, 5
    # and 6 tie at the top (so groups 0 .. 3 tie too), so the lower ones are chosen
    config = RoutingConfig(8, 2, method, "sigmoid", num_groups=4, topk_groups=2)
    logits = torch.tensor([[0.0, 3.0, 3.0, 0.0, 0.0, 3.0, 3.0, 0.0]])
    _, ids = OPS.moe_route(logits, config)
    assert sorted(ids[0].tolist()) == [1, 2]


# ---------------------------------------------------------------------------------- round_to_format


def test_fp8_power_of_two_amax_gives_that_scale_exactly():
    # amax 448 * 2^-3 = 56: scale 2^-3, so values that are e4m3 * 2^-3 come back unchanged, and the ties at
    # 9.5 and 10.5 (e4m3's step is 1 in [8, 16)) round to the even 10
    x = _block([56.0, -56.0, 1.0, -0.5, 9.5 / 8, 10.5 / 8, 2**-12], 32)
    out = OPS.round_to_format(x, FP8)
    assert out[0, :7].tolist() == [56.0, -56.0, 1.0, -0.5, 10 / 8, 10 / 8, 2**-12]
    # just above 56 the scale is 2^-2: 57 / 2^-2 = 228 lies between e4m3's 224 and 240, so 224 * 2^-2 = 56
    assert OPS.round_to_format(_block([57.0, 1.0], 32), FP8)[0, :2].tolist() == [56.0, 1.0]


def test_fp8_amax_is_clamped_to_1e4():
    # amax 1e-6 < 1e-4: scale pow2ceil(1e-4 / 448) = 2^-22; 1e-6 / 2^-22 = 4.19 rounds to e4m3's 4
    out = OPS.round_to_format(_block([1e-6], 32), FP8)
    assert out[0, 0].item() == 4 * 2**-22
    assert not OPS.round_to_format(torch.zeros(2, 64), FP8).any()


E2M1_TIES = [  # (q = x / scale, rounded): the ties half to even on {0, .5, 1, 1.5, 2, 3, 4, 6}, then others
    (6.0, 6.0), (0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0),
    (-2.5, -2.0), (-0.75, -1.0), (-5.0, -4.0), (0.2, 0.0), (0.3, 0.5), (2.6, 3.0), (4.9, 4.0), (5.1, 6.0),
]  # fmt: skip


def test_fp4_power_of_two_scale_rounds_ties_as_specified():
    scale = 2.0**-2  # amax 6 * 2^-2 = 1.5: scale pow2ceil(1.5 / 6) = 2^-2 exactly
    x = _block([q * scale for q, _ in E2M1_TIES] + [-0.25 * scale], 32)
    out = OPS.round_to_format(x, FP4)[0]
    assert out[: len(E2M1_TIES)].tolist() == [r * scale for _, r in E2M1_TIES]
    negative_tie = out[len(E2M1_TIES)]  # -0.25 rounds to zero, and a zero is +0 (code 8 reads 0.0)
    assert negative_tie.item() == 0.0 and not negative_tie.signbit()
    # the same values at a scale four times larger: the block's amax decides the scale
    x4 = _block([q * 4 * scale for q, _ in E2M1_TIES], 32)
    assert OPS.round_to_format(x4, FP4)[0, : len(E2M1_TIES)].tolist() == [r * 4 * scale for _, r in E2M1_TIES]


def test_fp4_e4m3_scale_need_not_be_a_power_of_two():
    # amax 3.75: scale 3.75 / 6 = 0.625 (e4m3 1.25 * 2^-1), not a power of two
    scale = 0.625
    x = _block([q * scale for q, _ in E2M1_TIES[:16]], 16)
    assert OPS.round_to_format(x, FP4_E4M3)[0].tolist() == [r * scale for _, r in E2M1_TIES[:16]]
    # amax 3.6: 3.6 / 6 = 0.6 rounds to e4m3's 0.625 (the step is 1/16 in [0.5, 1)); 3.6 / 0.625 = 5.76 -> 6
    out = OPS.round_to_format(_block([3.6, 1.0], 16), FP4_E4M3)[0]
    assert out[:2].tolist() == [6 * 0.625, 1.5 * 0.625]  # 1.0 / 0.625 = 1.6 -> 1.5


def _pow2ceil(t: float) -> float:
    mantissa, exponent = math.frexp(t)  # t = mantissa * 2^exponent, mantissa in [0.5, 1)
    return 2.0 ** (exponent - 1) if mantissa == 0.5 else 2.0**exponent


def _e2m1(q: float) -> float:
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    best = min(range(8), key=lambda i: (abs(abs(q) - grid[i]), i % 2))  # nearest, a tie to the even code
    return math.copysign(grid[best], q) if grid[best] else 0.0


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def _round_loop(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """round_to_format written out per block and element from the formulas (float32 at each step)."""
    block = int(fmt.rsplit(":", 1)[1])
    out = []
    for row in x.float().tolist():
        for start in range(0, len(row), block):
            values = row[start : start + block]
            amax = max(abs(v) for v in values)
            if fmt == FP8:
                scale = _pow2ceil(_f32(max(amax, _f32(1e-4)) * _f32(1 / 448)))
                q = torch.tensor([min(max(v / scale, -448.0), 448.0) for v in values]).to(torch.float8_e4m3fn)
                out += [float(v) * scale for v in q.float()]
            else:
                if fmt == FP4:
                    scale = _pow2ceil(_f32(max(amax, 6 * 2**-126) * _f32(1 / 6)))
                else:
                    scale = float(torch.tensor(_f32(max(amax, 6 * 2**-9) / 6)).to(torch.float8_e4m3fn).float())
                out += [_e2m1(_f32(min(max(_f32(v / scale), -6.0), 6.0))) * scale for v in values]
    return torch.tensor(out, dtype=torch.float64).view(x.shape)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_to_format_matches_per_element_loop_and_keeps_dtype(fmt, dtype):
    # blocks of very different magnitudes, outliers included
    x = torch.randn(3, 64, generator=_gen(1)) * torch.tensor([0.1, 1.0, 30.0])[:, None]
    x[1, 5] = 200.0
    x = x.to(dtype)
    out = OPS.round_to_format(x, fmt)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out.double(), _round_loop(x, fmt))


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_round_to_format_is_idempotent_and_exact_in_bfloat16(fmt):
    # magnitudes >= 0.1: below 6 * 2^-6 an e4m3 scale is subnormal, too coarse for a second rounding to
    # keep the first one's scale (the format then is not idempotent)
    x = torch.randn(8, 96, generator=_gen(2)) * torch.logspace(-1, 3, 8)[:, None]
    once = OPS.round_to_format(x, fmt)
    assert torch.equal(OPS.round_to_format(once, fmt), once)
    assert torch.equal(once.to(torch.bfloat16).float(), once)  # caches may store the rounded values in bf16


def test_round_to_format_refuses_unknown_formats_and_partial_blocks():
    with pytest.raises(ValueError, match="unknown block format 'fp8_e5m2/pow2:32'"):
        OPS.round_to_format(torch.zeros(2, 32), "fp8_e5m2/pow2:32")
    with pytest.raises(ValueError, match="multiple of 16"):
        OPS.round_to_format(torch.zeros(2, 40), FP4_E4M3)


# ---------------------------------------------------------------------------------- hyper-connections


def _mixer(n: int, dim: int, seed: int):
    fn = torch.randn((2 + n) * n, n * dim, generator=_gen(seed)) * (n * dim) ** -0.5
    return (
        fn,
        1 + 0.5 * torch.randn(3, generator=_gen(seed + 1)),
        0.5 * torch.randn((2 + n) * n, generator=_gen(seed + 2)),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_mixes_and_collapse_are_hc_pre_split(dtype):
    streams = torch.randn(6, 4, 32, generator=_gen(3)).to(dtype)
    kwargs = dict(sinkhorn_iters=3, eps=1e-6, norm_eps=1e-20)
    pre, post, comb = OPS.hc_mixes(streams, *_mixer(4, 32, 4), **kwargs)
    collapsed, want_post, want_comb = OPS.hc_pre(streams, *_mixer(4, 32, 4), **kwargs)
    assert pre.dtype == post.dtype == comb.dtype == torch.float32
    assert pre.shape == post.shape == (6, 4) and comb.shape == (6, 4, 4)
    assert torch.equal(post, want_post) and torch.equal(comb, want_comb)
    assert torch.equal(OPS.hc_collapse(streams, pre), collapsed)
    with pytest.raises(ValueError, match="layer form"):  # the head form (fn [N, N*D]) has no post / comb
        OPS.hc_mixes(streams, torch.zeros(4, 128), torch.ones(1), torch.zeros(4), **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_collapse_matches_float64(dtype):
    streams = torch.randn(5, 3, 16, generator=_gen(5)).to(dtype)
    pre = torch.rand(5, 3, generator=_gen(6)) + 0.1
    expected = (pre.double()[:, :, None] * streams.double()).sum(dim=1)
    out = OPS.hc_collapse(streams, pre)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_expand_matches_float64_with_one_cast(dtype):
    tokens, n, dim = 7, 4, 64
    block_out = torch.randn(tokens, dim, generator=_gen(7)).to(dtype)
    streams = torch.randn(tokens, n, dim, generator=_gen(8)).to(dtype)
    post = 2 * torch.randn(tokens, n, generator=_gen(9)).sigmoid()
    comb = torch.randn(tokens, n, n, generator=_gen(10)).softmax(dim=-1)  # comb[j, k] != comb[k, j]
    expected = torch.empty(tokens, n, dim, dtype=torch.float64)
    for t in range(tokens):
        for k in range(n):
            mixed = sum(float(comb[t, j, k]) * streams[t, j].double() for j in range(n))
            expected[t, k] = float(post[t, k]) * block_out[t].double() + mixed
    out = OPS.hc_expand(block_out, streams, post, comb)
    assert out.dtype == dtype and out.shape == (tokens, n, dim)
    torch.testing.assert_close(out, expected.to(dtype), rtol=1e-6 if dtype == torch.float32 else 0, atol=1e-6)
    if dtype == torch.bfloat16:  # hc_post rounds post and comb to bf16 first: further from the exact value
        v4 = OPS.hc_post(block_out, streams, post, comb)
        assert (v4.double() - expected).abs().sum() > (out.double() - expected).abs().sum()


# ---------------------------------------------------------------------------------------- engram_gate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engram_gate_matches_float64_formula(dtype):
    tokens, n, dim, eps = 6, 4, 16, 1e-20
    streams = torch.randn(tokens, n, dim, generator=_gen(11)).to(dtype)
    key = torch.randn(tokens, n, dim, generator=_gen(12))
    key[2, 1] = 0.0  # dot 0: sign 0, so the gate is sigmoid(0) = 0.5
    value = torch.randn(tokens, dim, generator=_gen(13)).to(dtype)
    weight = torch.rand(n, dim, generator=_gen(14)) + 0.5
    dead = torch.tensor([False, True, False, False, True, False])
    expected = torch.empty(tokens, n, dim, dtype=torch.float64)
    for t in range(tokens):
        for s in range(n):
            h, k = streams[t, s].double().tolist(), key[t, s].double().tolist()
            rstd = (sum(v * v for v in h) / dim + eps) ** -0.5 * (sum(v * v for v in k) / dim + eps) ** -0.5
            dot = sum(a * float(w) * b for a, w, b in zip(h, weight[s], k)) * rstd / math.sqrt(dim)
            gate = 0.0 if dead[t] else 1 / (1 + math.exp(-math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot)))
            if dot == 0 and not dead[t]:
                gate = 0.5
            expected[t, s] = streams[t, s].double() + gate * value[t].double()
    out = OPS.engram_gate(streams, key, value, weight, dead, eps=eps)
    assert out.dtype == dtype and out.shape == streams.shape
    torch.testing.assert_close(out, expected.to(dtype), rtol=1e-5 if dtype == torch.float32 else 1.6e-2, atol=1e-5)
    assert torch.equal(out[dead], streams[dead])  # dead tokens take nothing
    torch.testing.assert_close(out[2, 1], (streams[2, 1].double() + 0.5 * value[2].double()).to(dtype))


# ------------------------------------------------------------------------------------- indexer_select

BLOCK = 8  # tokens per KV block (the paged layout), not the indexer's blocks of entries
KEY_DIM = 4


def _index_step(steps: list[tuple[int, int]], keys: list[torch.Tensor], rate: int):
    """A paged cache of indexer keys (sequence b's keys[b] [seq_len // rate, KEY_DIM], shuffled blocks, poison
    elsewhere) and the metadata of one step of sequences (seq_len, q_len)."""
    layout = ReferenceKVLayout(CPU, block_size=BLOCK)
    spec = CacheSpec(CacheKind.PAGED, torch.float32, 1, KEY_DIM, compress_rate=rate)
    num_blocks = 8 * len(keys) + 4  # 8 blocks (64 tokens) per sequence, some unused
    cache = layout.allocate(spec, num_blocks)
    layout.write(cache, spec, torch.arange(cache.shape[0]), torch.full(cache.shape, 99.0))
    free = torch.randperm(num_blocks, generator=_gen(20)).tolist()
    tables = []
    for seq_keys in keys:
        table = torch.tensor([free.pop() for _ in range(8)])
        layout.write(cache, spec, compressed_slots(table, torch.arange(len(seq_keys)), BLOCK, rate), seq_keys[:, None])
        tables.append(table)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0] + [q for _, q in steps]).cumsum(0),
        seq_lens=torch.tensor([s for s, _ in steps]),
        block_tables=torch.stack(tables),
        slot_mapping=torch.zeros(sum(q for _, q in steps), dtype=torch.int64),  # unused
    )
    return ReferenceAttention(layout), cache, spec, meta


def _keys(count: int, seed: int) -> torch.Tensor:
    """Keys whose scores against the queries below are small integers (exact in float32 and float64): many
    ties, and many exact zeros from the ReLU."""
    g = _gen(seed)
    keys = torch.zeros(count, KEY_DIM)
    keys[:, 0] = torch.randint(-2, 5, (count,), generator=g).float()
    keys[:, 1] = torch.randint(-1, 2, (count,), generator=g).float()
    return keys


def _queries(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, 2, KEY_DIM] = (1, c, 0, 0) per head with c in {0, 1, 2}; weights [T, 2] = (1, 0.5)."""
    q = torch.zeros(tokens, 2, KEY_DIM)
    q[:, :, 0] = 1.0
    q[:, :, 1] = torch.randint(0, 3, (tokens, 2), generator=_gen(seed)).float()
    return q, torch.tensor([[1.0, 0.5]]).expand(tokens, 2)


def _select_loop(q, weights, keys, steps, rate, top_k, within=None, block_size=1, top_blocks=0):
    """indexer_select per query from the contract's words, ranking by (score desc, number asc)."""
    indices, blocks, row = [], [], 0
    for (seq_len, q_len), seq_keys in zip(steps, keys):
        for position in range(seq_len - q_len, seq_len):
            visible = (position + 1) // rate
            scores = [
                sum(float(weights[row, h]) * max(0.0, float(q[row, h] @ seq_keys[w])) for h in range(2))
                for w in range(visible)
            ]
            listed = set(within[row].tolist()) if within is not None else None
            candidates = [w for w in range(visible) if listed is None or w // block_size in listed]
            best = [w for _, w in sorted((-scores[w], w) for w in candidates)][:top_k]
            indices.append(best + [-1] * (top_k - len(best)))
            seen = -(-visible // block_size)  # blocks holding a visible entry
            newest = (visible - 1) // block_size  # pinned: ranked first
            block_best = [max(scores[j * block_size : (j + 1) * block_size]) for j in range(seen)]
            kept = [j for *_, j in sorted((j != newest, -block_best[j], j) for j in range(seen))][:top_blocks]
            blocks.append(kept + [-1] * (top_blocks - len(kept)))
            row += 1
    return torch.tensor(indices, dtype=torch.int64), torch.tensor(blocks, dtype=torch.int64).view(row, top_blocks)


def _same_sets(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Rows equal as sets (the order of the picks is free), -1 padding included."""
    assert actual.dtype == torch.int64 and actual.shape == expected.shape
    assert torch.equal(actual.sort(dim=1).values, expected.sort(dim=1).values)


STEPS = [(37, 37), (50, 9), (12, 0), (64, 1), (3, 3)]  # prefill, chunked prefill, no queries, decode, too short


@pytest.mark.parametrize("rate", [1, 2])
def test_indexer_select_top_k_ties_go_to_lower_entries(rate):
    keys = [_keys(seq_len // rate, seed=30 + b) for b, (seq_len, _) in enumerate(STEPS)]
    attention, cache, spec, meta = _index_step(STEPS, keys, rate)
    q, weights = _queries(sum(q for _, q in STEPS), seed=40)
    for top_k in (1, 5, 64):  # top_k cuts through groups of equal scores, or exceeds the visible entries
        indices, blocks = attention.indexer_select(q, weights, cache, spec, meta, top_k=top_k, scale=1.0)
        assert blocks is None
        _same_sets(indices, _select_loop(q, weights, keys, STEPS, rate, top_k)[0])
        # the same choice as V4's indexer_topk (which shares the scores and the tie rule)
        picks = attention.indexer_topk(q, weights, cache, spec, meta, top_k=top_k, scale=1.0)
        _same_sets(indices, picks)


@pytest.mark.parametrize("block_size", [1, 4])
def test_indexer_select_restricts_to_the_listed_blocks(block_size):
    rate = 1
    keys = [_keys(seq_len // rate, seed=50 + b) for b, (seq_len, _) in enumerate(STEPS)]
    attention, cache, spec, meta = _index_step(STEPS, keys, rate)
    tokens = sum(q for _, q in STEPS)
    q, weights = _queries(tokens, seed=51)
    # per query: random block ids (some not visible yet, some past every entry), -1 padding, a repeat
    within = torch.randint(-1, 70 // block_size, (tokens, 6), generator=_gen(52))
    within[:, -1] = within[:, 0]
    indices, _ = attention.indexer_select(
        q, weights, cache, spec, meta, top_k=6, scale=1.0, within=within, block_size=block_size
    )
    expected, _ = _select_loop(q, weights, keys, STEPS, rate, 6, within=within, block_size=block_size)
    _same_sets(indices, expected)
    picked = indices >= 0
    assert ((indices // block_size)[:, :, None] == within[:, None, :]).any(dim=-1)[picked].all()
    assert (expected < 0).any() and picked.any()  # some queries have fewer candidates than top_k


@pytest.mark.parametrize("block_size", [2, 4])
def test_indexer_select_top_blocks_pins_the_newest_block(block_size):
    rate = 2
    keys = [_keys(seq_len // rate, seed=60 + b) for b, (seq_len, _) in enumerate(STEPS)]
    for seq_keys in keys:  # the newest entries score 0: only the pin keeps their block
        seq_keys[-3:] = torch.tensor([-1.0, 0.0, 0.0, 0.0])
    attention, cache, spec, meta = _index_step(STEPS, keys, rate)
    tokens = sum(q for _, q in STEPS)
    q, weights = _queries(tokens, seed=61)
    within = torch.zeros(tokens, 1, dtype=torch.int64)  # restricts the indices, never the blocks
    indices, blocks = attention.indexer_select(
        q, weights, cache, spec, meta, top_k=4, scale=1.0, within=within, block_size=block_size, top_blocks=3
    )
    want_indices, want_blocks = _select_loop(
        q, weights, keys, STEPS, rate, 4, within=within, block_size=block_size, top_blocks=3
    )
    _same_sets(indices, want_indices)
    _same_sets(blocks, want_blocks)
    positions = torch.cat([torch.arange(s - n, s) for s, n in STEPS])
    visible = (positions + 1) // rate
    newest = (visible - 1) // block_size
    seen = visible > 0
    assert (blocks[seen] == newest[seen, None]).any(dim=1).all()  # the newest block is always kept
    assert (blocks[~seen] == -1).all()  # no visible entry, no block
    assert ((blocks >= 0).sum(dim=1) == torch.clamp(-(-visible // block_size), max=3)).all()


def test_indexer_select_planted_ties_resolve_to_lower_numbers():
    rate, block_size = 1, 4
    keys = torch.zeros(24, KEY_DIM)
    keys[[3, 9, 14, 17, 21], 0] = 2.0  # five entries tie at the top score, in blocks 0, 2, 3, 4, 5
    keys[[1, 6], 0] = 1.0
    attention, cache, spec, meta = _index_step([(24, 1)], [keys], rate)
    q, weights = torch.zeros(1, 1, KEY_DIM), torch.ones(1, 1)
    q[0, 0, 0] = 1.0
    indices, blocks = attention.indexer_select(
        q, weights, cache, spec, meta, top_k=3, scale=1.0, block_size=block_size, top_blocks=3
    )
    assert sorted(indices[0].tolist()) == [3, 9, 14]
    # the newest block (5) first, then of blocks 0, 2, 3, 4 (max 2 each) the lower two
    assert sorted(blocks[0].tolist()) == [0, 2, 5]


def test_indexer_select_does_not_depend_on_chunking():
    rate, block_size, seq_len = 2, 4, 61
    keys = [_keys(seq_len // rate, seed=70)]
    q, weights = _queries(seq_len, seed=71)
    within = torch.randint(-1, 8, (seq_len, 3), generator=_gen(72))
    kwargs = dict(top_k=5, scale=1.0, block_size=block_size, top_blocks=2)
    results = []
    for chunks in ([seq_len], [20, 1, 40], [7] * 8 + [5]):
        picks, kept, start = [], [], 0
        for size in chunks:
            attention, cache, spec, meta = _index_step([(start + size, size)], keys, rate)
            rows = slice(start, start + size)
            got = attention.indexer_select(q[rows], weights[rows], cache, spec, meta, within=within[rows], **kwargs)
            picks.append(got[0])
            kept.append(got[1])
            start += size
        results.append((torch.cat(picks), torch.cat(kept)))
    for picks, kept in results[1:]:
        assert torch.equal(picks, results[0][0]) and torch.equal(kept, results[0][1])
    _same_sets(results[0][0], _select_loop(q, weights, keys, [(seq_len, seq_len)], rate, 5, within, block_size)[0])
