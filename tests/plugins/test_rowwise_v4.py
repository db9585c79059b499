"""The example backend plugins/rowwise_cpu on DeepSeek-V4: every op of V4_OPS against the reference backend
(float32 and bfloat16), bitwise batch invariance of the new ops, and a tiny V4 checkpoint generating the
reference backend's tokens end to end.

Like test_rowwise_cpu.py, the distribution is used as installed here; where it is not, the session installs
it with pip into a temporary directory put on sys.path.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from deepinfer_core.backend.ops import V4_OPS, AttentionMetadata, RoutingConfig
from deepinfer_core.backend.registry import discover
from deepinfer_core.backend.resolve import resolve_backend
from deepinfer_core.backend.selection import select_backend
from deepinfer_core.kv.layout import CacheKind, CacheSpec, compressed_slots, ring_slots
from deepinfer_core.reference.attention import ReferenceAttention
from deepinfer_core.reference.kv import ReferenceKVLayout
from deepinfer_core.reference.ops import ReferenceOps
from deepinfer_core.sampling.params import SamplingParams

REF = ReferenceOps()
DTYPES = [torch.float32, torch.bfloat16]
BLOCK = 16


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py


@pytest.fixture(scope="session")
def rw(install_distributions):
    """The rowwise_cpu backend as the engine builds it (float32, block size 16), through its hooks."""
    try:
        importlib.metadata.distribution("deepinfer-rowwise-cpu")
    except importlib.metadata.PackageNotFoundError:
        sys.path.insert(0, str(install_distributions("rowwise_cpu")))
        importlib.invalidate_caches()
    return resolve_backend(select_backend(discover(), "rowwise_cpu"), dtype=torch.float32, block_size=BLOCK)


def _randn(*shape, seed=0, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _close(got, want, name):
    assert got.dtype == want.dtype and got.shape == want.shape, name
    torch.testing.assert_close(got, want, msg=name)


def test_declares_every_v4_op(rw):
    assert all(rw.capabilities.supports(op) is True for op in V4_OPS)


# ------------------------------------------------------------------------------ dense ops against the reference


def _hc_args(n, dim, full, seed):
    mixes = (2 + n) * n if full else n
    fn = _randn(mixes, n * dim, seed=seed, scale=0.3)
    return fn, _randn(3 if full else 1, seed=seed + 1), _randn(mixes, seed=seed + 2, scale=0.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_v4_dense_ops_match_reference(rw, dtype):
    ops, checks = rw.ops, {}
    for n, full in ((2, True), (3, True), (3, False)):
        streams = _randn(7, n, 24, seed=n, dtype=dtype, scale=2.0)
        fn, scale, base = _hc_args(n, 24, full, seed=10 * n)
        kwargs = dict(sinkhorn_iters=4, eps=1e-6, norm_eps=1e-6)
        got, want = ops.hc_pre(streams, fn, scale, base, **kwargs), REF.hc_pre(streams, fn, scale, base, **kwargs)
        _close(got[0], want[0], f"hc_pre collapsed n={n} full={full}")
        if not full:
            assert got[1] is None and got[2] is None
            continue
        _close(got[1], want[1], f"hc_pre post n={n}")
        _close(got[2], want[2], f"hc_pre comb n={n}")
        block_out = _randn(7, 24, seed=3, dtype=dtype)
        checks[f"hc_post n={n}"] = (
            ops.hc_post(block_out, streams, *got[1:]),
            REF.hc_post(block_out, streams, *want[1:]),
        )
    values, logits = _randn(5, 8, 12, seed=4, dtype=dtype), _randn(5, 8, 12, seed=5, scale=3.0)
    logits[:, :3] = float("-inf")  # CSA's first window: slots without a token take no part
    logits[2, 5:, 7] = float("-inf")
    checks["softmax_pool"] = (ops.softmax_pool(values, logits), REF.softmax_pool(values, logits))
    x = _randn(9, 40, seed=6, dtype=dtype, scale=2.0)
    for limit in (0.5, 0.3, 7.0):
        checks[f"silu_and_mul limit={limit}"] = (ops.silu_and_mul(x, limit=limit), REF.silu_and_mul(x, limit=limit))
    counts = torch.tensor([3, 0, 2, 4])
    x, w13, w2 = (
        _randn(9, 16, dtype=dtype),
        _randn(4, 16, 16, seed=1, dtype=dtype),
        _randn(4, 16, 8, seed=2, dtype=dtype),
    )
    got = ops.expert_ffn(x, counts, w13, w2, swiglu_limit=0.5)
    checks["expert_ffn swiglu_limit"] = (got, REF.expert_ffn(x, counts, w13, w2, swiglu_limit=0.5))
    assert torch.equal(got[3:5], ops.linear(ops.silu_and_mul(ops.linear(x[3:5], w13[2]), limit=0.5), w2[2]))
    for name, (got, want) in checks.items():
        _close(got, want, name)


def _v4_routing_cases():
    table = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(i))[:2] for i in range(9)])
    return {
        "sqrtsoftplus-greedy-bias": (RoutingConfig(8, 2, scoring="sqrtsoftplus", normalize=True), 0.05, None),
        "sqrtsoftplus-noaux": (RoutingConfig(16, 4, "noaux_tc", "sqrtsoftplus", 4, 2, True, 1.5), 0.05, None),
        "hash-sqrtsoftplus": (RoutingConfig(8, 2, "hash", "sqrtsoftplus", normalize=True), 0.5, table),
        "hash-softmax-scaled": (RoutingConfig(8, 2, "hash", routed_scaling_factor=2.5), None, table),
    }


@pytest.mark.parametrize("case", _v4_routing_cases().values(), ids=_v4_routing_cases().keys())
def test_v4_routing_matches_reference(rw, case):
    config, bias_scale, table = case
    logits = _randn(9, config.num_experts, seed=7, scale=8.0)  # softplus on both sides of its threshold 20
    logits[0, 0], logits[1, 1] = 30.0, -30.0
    bias = None if bias_scale is None else _randn(config.num_experts, seed=8, scale=bias_scale)
    weights, ids = rw.ops.moe_route(logits, config, bias, expert_ids=table)
    ref_weights, ref_ids = REF.moe_route(logits, config, bias, expert_ids=table)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids.sort(dim=1).values, ref_ids.sort(dim=1).values)
    order, ref_order = ids.argsort(dim=1), ref_ids.argsort(dim=1)
    torch.testing.assert_close(weights.gather(1, order), ref_weights.gather(1, ref_order))
    if table is not None:
        assert torch.equal(ids, table)
    with pytest.raises(ValueError, match="expert_ids"):
        rw.ops.moe_route(logits, RoutingConfig(8, 2, "hash"))


# ------------------------------------------------------------------------------ V4 attention against the reference

# (seq_len, q_len, window_start): prefill, chunk, decodes, an empty slot, a sequence admitted at 24
SEQS = [(27, 27, 0), (50, 6, 0), (20, 0, 0), (33, 1, 0), (17, 3, 0), (61, 5, 24)]


def _v4_batch(layouts, dtype, *, window=8, rate=4, dim=16, seed=1):
    """The same random V4 caches in every layout of `layouts`, for SEQS in shuffled blocks and sequence slots:
    ((rings, compressed caches), ring_spec, compressed_spec, meta, kv [T, D])."""
    g = torch.Generator().manual_seed(seed)
    ring_spec = CacheSpec(CacheKind.SLIDING_WINDOW, dtype, 1, dim, window=window, rollback_slots=6)
    comp_spec = CacheSpec(CacheKind.PAGED, dtype, 1, dim, compress_rate=rate)
    per_block = BLOCK // rate
    rings = [layout.allocate(ring_spec, len(SEQS)) for layout in layouts]
    comps = [layout.allocate(comp_spec, 24) for layout in layouts]
    for layout, ring, comp in zip(layouts, rings, comps):  # stale entries everywhere: a wrong read shows up
        layout.write(ring, ring_spec, torch.arange(len(SEQS) * ring_spec.ring_size), 40 * torch.ones(1, 1, dim))
        layout.write(comp, comp_spec, torch.arange(24 * per_block), 40 * torch.ones(1, 1, dim))
    free, seq_slots = torch.randperm(24, generator=g).tolist(), torch.randperm(len(SEQS), generator=g).tolist()
    tables, kv = [], []
    for (seq_len, q_len, since), slot in zip(SEQS, seq_slots):
        first = seq_len - q_len
        table = [free.pop() for _ in range(-(-seq_len // BLOCK))]
        tables.append(table + [-1] * (4 - len(table)))
        earlier = torch.arange(max(since, first - ring_spec.ring_size), first)  # what the ring still holds
        entries = torch.arange(seq_len // rate)
        ring_values = torch.randn(len(earlier), 1, dim, generator=g)
        comp_values = torch.randn(len(entries), 1, dim, generator=g)
        for layout, ring, comp in zip(layouts, rings, comps):
            layout.write(ring, ring_spec, ring_slots(slot, earlier, ring_spec.ring_size), ring_values)
            layout.write(comp, comp_spec, compressed_slots(torch.tensor(table), entries, BLOCK, rate), comp_values)
        kv.append(torch.randn(q_len, dim, generator=g))
    meta = AttentionMetadata(
        torch.tensor([0] + [q for _, q, _ in SEQS]).cumsum(0),
        torch.tensor([s for s, _, _ in SEQS]),
        torch.tensor(tables),
        torch.zeros(sum(q for _, q, _ in SEQS), dtype=torch.int64),  # unused by the V4 ops
        seq_slots=torch.tensor(seq_slots),
        window_starts=torch.tensor([w for _, _, w in SEQS]),
        cached_lens=torch.zeros(len(SEQS), dtype=torch.int64),
    )
    return (rings, comps), ring_spec, comp_spec, meta, torch.cat(kv).to(dtype)


def _positions(meta):
    starts = meta.query_start_loc.tolist()
    return torch.cat([torch.arange(s - (starts[b + 1] - starts[b]), s) for b, s in enumerate(meta.seq_lens.tolist())])


def _indices(meta, rate, top_k=6, seed=2, past_the_end=False):
    """Random picks per query: visible, invisible and repeated entries, and -1 padding; with past_the_end
    also entries the sequence does not have yet (the reference raises IndexError on those)."""
    visible = (_positions(meta) + 1) // rate  # [T]
    counts = torch.repeat_interleave(meta.seq_lens // rate, meta.query_start_loc.diff())  # [T]
    g = torch.Generator().manual_seed(seed)
    picks = (torch.rand(len(visible), top_k, generator=g) * (visible[:, None] + 3)).long()
    if not past_the_end:
        picks = torch.minimum(picks, counts[:, None] - 1)
    picks[:, -2] = picks[:, 0]  # a repeat counts once
    picks[torch.rand(len(visible), top_k, generator=g) < 0.25] = -1
    return picks


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["window", "compressed", "indexed"])
def test_sparse_attention_matches_reference(rw, dtype, mode):
    ref_layout = ReferenceKVLayout(torch.device("cpu"), block_size=BLOCK)
    (rings, comps), ring_spec, comp_spec, meta, kv = _v4_batch([rw.kv_layout, ref_layout], dtype)
    q = _randn(kv.shape[0], 4, 16, seed=9, dtype=dtype)
    kwargs = dict(sinks=_randn(4, seed=3), scale=0.4)
    if mode != "window":
        kwargs |= dict(compressed_spec=comp_spec, indices=_indices(meta, 4) if mode == "indexed" else None)
    mine, theirs = ({} if mode == "window" else dict(compressed=c) for c in comps)
    got = rw.attention.sparse_attention(q, kv, rings[0], ring_spec, meta, **mine, **kwargs)
    want = ReferenceAttention(ref_layout).sparse_attention(q, kv, rings[1], ring_spec, meta, **theirs, **kwargs)
    _close(got, want, mode)
    if mode == "indexed":  # entries past the sequence's end, like invisible ones, are not attended
        wild = _indices(meta, 4, past_the_end=True)
        tame = torch.where(wild < ((_positions(meta) + 1) // 4)[:, None], wild, -1)
        assert not torch.equal(wild, tame)
        picked = [
            rw.attention.sparse_attention(q, kv, rings[0], ring_spec, meta, **mine, **kwargs | {"indices": i})
            for i in (wild, tame)
        ]
        assert torch.equal(*picked)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("top_k", [3, 64])
def test_indexer_topk_matches_reference(rw, dtype, top_k):
    ref_layout = ReferenceKVLayout(torch.device("cpu"), block_size=BLOCK)
    (_, comps), _, spec, meta, _ = _v4_batch([rw.kv_layout, ref_layout], dtype, rate=2, dim=8, seed=4)
    q = _randn(int(meta.query_start_loc[-1]), 3, 8, seed=5, dtype=dtype)
    q[::3] = -q[::3].abs()  # with the keys' signs below, rows whose scores are mostly exact-zero ties
    for layout, cache in zip((rw.kv_layout, ref_layout), comps):
        slots = torch.arange(24 * BLOCK // 2)
        layout.write(cache, spec, slots, layout.gather(cache, spec, slots).abs())
    weights = _randn(q.shape[0], 3, seed=6).abs()
    kwargs = dict(top_k=top_k, scale=8**-0.5)
    got = rw.attention.indexer_topk(q, weights, comps[0], spec, meta, **kwargs)
    want = ReferenceAttention(ref_layout).indexer_topk(q, weights, comps[1], spec, meta, **kwargs)
    assert got.dtype == torch.int64 and got.shape == want.shape == (q.shape[0], top_k)
    assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)  # the same set, ties to lower entries


# ------------------------------------------------------------------------------ batch invariance (bitwise)


def test_v4_rows_do_not_depend_on_the_batch(rw):
    ops, rows = rw.ops, [0, 1, 17, 36]
    streams, out = _randn(37, 3, 24, seed=1, dtype=torch.bfloat16), _randn(37, 24, seed=2, dtype=torch.bfloat16)
    fn, scale, base = _hc_args(3, 24, True, seed=3)
    _, post, comb = ops.hc_pre(streams, fn, scale, base, sinkhorn_iters=3, eps=1e-6, norm_eps=1e-6)
    logits = _randn(37, 8, seed=4, scale=4.0)
    values, pool = _randn(37, 6, 24, seed=5, dtype=torch.bfloat16), _randn(37, 6, 24, seed=6)
    route = RoutingConfig(8, 2, scoring="sqrtsoftplus", normalize=True)
    table = torch.randint(8, (37, 2), generator=torch.Generator().manual_seed(7))
    hc = dict(sinkhorn_iters=3, eps=1e-6, norm_eps=1e-6)
    batched = {
        "hc_pre": lambda s: torch.cat([t.flatten(1) for t in ops.hc_pre(streams[s].float(), fn, scale, base, **hc)], 1),
        "hc_post": lambda s: ops.hc_post(out[s], streams[s], post[s], comb[s]),
        "softmax_pool": lambda s: ops.softmax_pool(values[s], pool[s]),
        "sqrtsoftplus": lambda s: torch.cat(ops.moe_route(logits[s], route), dim=1),
        "hash": lambda s: torch.cat(ops.moe_route(logits[s], RoutingConfig(8, 2, "hash"), expert_ids=table[s]), 1),
        "swiglu": lambda s: ops.silu_and_mul(out[s], limit=0.5),
    }
    for name, op in batched.items():
        full = op(slice(None))
        for r in rows:
            assert torch.equal(op(slice(r, r + 1))[0], full[r]), (name, r)
        assert torch.equal(op(slice(10, 20)), full[10:20]), name


def test_v4_attention_row_is_the_same_alone_as_in_the_ragged_batch(rw):
    (rings, comps), ring_spec, comp_spec, meta, kv = _v4_batch([rw.kv_layout], torch.float32)
    tokens = kv.shape[0]
    q, iq = _randn(tokens, 4, 16, seed=9), _randn(tokens, 2, 16, seed=10)
    weights = _randn(tokens, 2, seed=11)
    kwargs = dict(sinks=_randn(4, seed=3), scale=0.4, compressed=comps[0], compressed_spec=comp_spec)
    picks = rw.attention.indexer_topk(iq, weights, comps[0], comp_spec, meta, top_k=5, scale=0.25)
    full = rw.attention.sparse_attention(q, kv, rings[0], ring_spec, meta, indices=picks, **kwargs)
    starts = meta.query_start_loc.tolist()
    for b, (seq_len, q_len, _) in enumerate(SEQS):
        for i in range(q_len):  # the same query as the last of a step that starts at the same first token
            t = starts[b] + i
            alone = AttentionMetadata(
                torch.tensor([0, i + 1]),
                torch.tensor([seq_len - q_len + i + 1]),
                meta.block_tables[b : b + 1],
                meta.slot_mapping[: i + 1],
                seq_slots=meta.seq_slots[b : b + 1],
                window_starts=meta.window_starts[b : b + 1],
                cached_lens=meta.cached_lens[b : b + 1],
            )
            rows = slice(starts[b], t + 1)
            one = rw.attention.indexer_topk(iq[rows], weights[rows], comps[0], comp_spec, alone, top_k=5, scale=0.25)
            assert torch.equal(one[-1], picks[t])
            got = rw.attention.sparse_attention(q[rows], kv[rows], rings[0], ring_spec, alone, indices=one, **kwargs)
            assert torch.equal(got[-1], full[t])


# ------------------------------------------------------------------------------ end to end


def _v4_helper():
    """tests/model/hf_v4_checkpoints.py as the one module per process tests/model/conftest.py loads."""
    name = "deepinfer_tests_hf_v4_checkpoints"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).parents[1] / "model" / "hf_v4_checkpoints.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.mark.parametrize("variant", ["a", "b", "small-topk"])
def test_v4_checkpoint_generates_the_reference_tokens(rw, tmp_path_factory, variant):
    pytest.importorskip("transformers")
    from deepinfer_core.engine.llm import LLM

    helper = _v4_helper()
    # variant b whose indexer keeps 4 of up to 38 entries: the selection (and its ties) matters
    helper.VARIANTS.setdefault("small-topk", {**helper.VARIANTS["b"], "index_topk": 4})
    helper.SEEDS.setdefault("small-topk", 2468)
    path = helper.build_v4_checkpoint(variant, tmp_path_factory.mktemp("hf-deepseek-v4")).path
    prompts = [[5, 6, 7, 8], list(range(20, 57)), [(7 * i) % 250 + 2 for i in range(70)]]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for accelerator in ("cpu", "rowwise_cpu"):
        llm = LLM(model=path, accelerator=accelerator, dtype="float32", block_size=16, num_kv_blocks=32, progress=False)
        tokens[accelerator] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert tokens["rowwise_cpu"] == tokens["cpu"]
    assert llm.backend.info.name == "rowwise_cpu"
    # chunked prefill (16-token steps, the ring carrying the window across chunks) gives the same tokens
    chunked = LLM(
        model=path,
        accelerator="rowwise_cpu",
        block_size=16,
        num_kv_blocks=32,
        max_num_batched_tokens=16,
        progress=False,
    )
    assert [o.outputs[0].token_ids for o in chunked.generate(prompts, greedy)] == tokens["cpu"]
