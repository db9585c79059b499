"""DeepSeek-V4 attention (sparse_attention) and the lightning indexer (indexer_topk) of the backend under
test against the reference, each over caches built in its own layout.

Both backends get the same canonical entries at the same logical positions: each sequence's window K = V
entries (the ring holds those of earlier steps, `kv` this step's) and its compressed entries (PAGED,
`compress_rate` tokens per entry). Each backend allocates and writes its caches through its own KVLayout,
in blocks of its own block size, at block ids and sequence slots the case shuffles, so the metadata is
built per backend from the same logical step. Every slot a query must not read holds large "poison":
unused blocks, the tail of a sequence's last block, ring slots of positions outside every query's window,
and ring slots of positions before `window_starts` (stale entries of the slot's previous sequence).
Steps mix prefills, chunked prefills (the ring is read), decodes and rows with no queries.
Attention outputs are compared within tolerance; the indexer's choices as a set per query.

Last, the whole model: greedy generation of the engine on a tiny DeepSeek-V4 checkpoint (deepinfer_conformance.tiny_v4),
on the backend under test and on the reference, tokens identical and top logprobs within float32 tolerance.
"""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer_core.backend.ops import V4_OPS, AttentionMetadata
from deepinfer_core.kv.layout import CacheKind, CacheSpec, compressed_slots, paged_slots, ring_slots

DTYPES = [torch.float32, torch.bfloat16]
HEADS, DIM = 4, 64  # query heads of the one shared K = V head of DIM
WINDOW, ROLLBACK = 8, 5  # a ring of 13 slots: positions one ring apart share a slot
INDEX_HEADS, INDEX_DIM, TOP_K = 2, 32, 8
POISON_SCALE = 30.0  # would dominate the softmax (or the indexer's scores) if read

# Sequences of one step as (seq_len, q_len, window_start): q_len == seq_len - window_start is a prefill
# (after a prefix hit when window_start > 0), a larger first position a chunked prefill, q_len 1 a decode,
# q_len 0 a row with nothing to compute. window_start > 0 with first position - window_start < WINDOW - 1:
# the stale ring entries below it would be in the window (96, 3, 91) and (20, 1, 16).
SCENARIOS = {
    "prefill_b1": [(37, 37, 0)],
    "ragged": [(45, 45, 0), (70, 27, 0), (133, 1, 0), (50, 0, 0), (96, 3, 91), (60, 12, 48), (1, 1, 0)],
    "decode": [(300, 1, 0), (17, 1, 0), (20, 1, 16), (9, 1, 0), (64, 1, 0)],
}
# sparse_attention's three layer kinds: sliding only; HCA (every visible compressed entry); CSA (those the
# indexer lists, some -1), each at two compress rates
MODES = {
    "sliding": (None, 0),
    "hca_r4": ("hca", 4),
    "hca_r8": ("hca", 8),
    "csa_r4": ("csa", 4),
    "csa_r8": ("csa", 8),
}


def randn(*shape, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def backends(suite, dtype: torch.dtype, block_size: str, kinds: tuple[CacheKind, ...], rate: int = 1):
    """(backend under test at its default or smallest block size, reference at its default), or skip."""
    for kind in kinds:
        suite.require_declared("cache_kinds", kind)
    suite.require_dtype(dtype)
    size = None if block_size == "default" else min(suite.capabilities.block_sizes)
    ours, ref = suite.resolved(suite.under_test, dtype, size), suite.resolved(suite.reference, dtype)
    for backend in (ours, ref):
        if backend.kv_layout.block_size % rate:
            pytest.skip(f"block size {backend.kv_layout.block_size} is not a multiple of compress rate {rate}")
    return ours, ref


def first_positions(seqs) -> list[int]:
    return [seq_len - q_len for seq_len, q_len, _ in seqs]


def query_positions(seqs) -> torch.Tensor:
    return torch.cat([torch.arange(seq_len - q_len, seq_len) for seq_len, q_len, _ in seqs])


class Step:
    """One step in `backend`'s own layout: block tables, sequence slots and metadata on its device, and
    caches it allocates, fills with poison, then writes the canonical entries each sequence owns."""

    def __init__(self, backend, seqs, seed: int) -> None:
        self.backend, self.seqs, self.seed = backend, seqs, seed
        self.layout, self.device = backend.kv_layout, backend.torch_device
        block_size = self.layout.block_size
        needed = [max(1, math.ceil(seq_len / block_size)) for seq_len, _, _ in seqs]
        self.num_blocks = 2 * sum(needed) + 3  # room for unused blocks between the ones handed out
        order = torch.randperm(self.num_blocks, generator=torch.Generator().manual_seed(seed))
        self.tables = torch.full((len(seqs), max(needed) + 1), -1, dtype=torch.int64)  # + an unused column
        ends = torch.tensor(needed).cumsum(0).tolist()
        for b, (count, end) in enumerate(zip(needed, ends)):
            self.tables[b, :count] = order[end - count : end]
        # sequence slots: shuffled, with spare slots that hold only poison
        self.num_slots = 2 * len(seqs) + 1
        self.seq_slots = torch.randperm(self.num_slots, generator=torch.Generator().manual_seed(seed + 1))[: len(seqs)]
        q_lens = torch.tensor([q_len for _, q_len, _ in seqs], dtype=torch.int64)
        starts = torch.tensor([start for _, _, start in seqs], dtype=torch.int64)
        mapping = [paged_slots(self.tables[b], torch.arange(f, s), block_size) for b, f, (s, _, _) in self._firsts()]
        self.meta = AttentionMetadata(
            query_start_loc=torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(self.device),
            seq_lens=torch.tensor([seq_len for seq_len, _, _ in seqs], dtype=torch.int64).to(self.device),
            block_tables=self.tables.to(self.device),
            slot_mapping=torch.cat(mapping).to(self.device),
            seq_slots=self.seq_slots.to(self.device),
            window_starts=starts.to(self.device),
            cached_lens=starts.to(self.device),  # unused by these ops; as after a prefix hit replayed from there
        )

    def _firsts(self):
        return [(b, first, seq) for b, (first, seq) in enumerate(zip(first_positions(self.seqs), self.seqs))]

    def _filled(self, spec: CacheSpec, units: int, slots: int, seed: int) -> torch.Tensor:
        cache = self.layout.allocate(spec, units)
        poison = randn(slots, *spec.entry_shape, seed=seed, dtype=spec.dtype, scale=POISON_SCALE)
        self.layout.write(cache, spec, torch.arange(slots).to(self.device), poison.to(self.device))
        return cache

    def ring(self, spec: CacheSpec, window_entries, reach: int | None = None) -> torch.Tensor:
        """The SLIDING_WINDOW ring holding, of each sequence, only the earlier positions some query of the
        step may see: max(window_start, first - reach, 0) .. first - 1, where `reach` is window - 1 (a
        sparse_attention query's) unless given (a DSpark block sees window)."""
        reach = spec.window - 1 if reach is None else reach
        cache = self._filled(spec, self.num_slots, self.num_slots * spec.ring_size, self.seed + 2)
        for b, first, (_, _, start) in self._firsts():
            positions = torch.arange(max(start, first - reach, 0), first)
            slots = ring_slots(int(self.seq_slots[b]), positions, spec.ring_size)
            values = window_entries[b][positions][:, None, :]
            self.layout.write(cache, spec, slots.to(self.device), values.to(self.device))
        return cache

    def compressed(self, spec: CacheSpec, entries) -> torch.Tensor:
        """A PAGED cache of compressed entries: sequence b's entries[b] [seq_len // rate, D] in its blocks."""
        block_size, rate = self.layout.block_size, spec.compress_rate
        cache = self._filled(spec, self.num_blocks, self.num_blocks * (block_size // rate), self.seed + 3)
        for b, seq_entries in enumerate(entries):
            slots = compressed_slots(self.tables[b], torch.arange(len(seq_entries)), block_size, rate)
            self.layout.write(cache, spec, slots.to(self.device), seq_entries[:, None, :].to(self.device))
        return cache


def csa_indices(seqs, rate: int, seed: int) -> torch.Tensor:
    """What an indexer could pick [T, TOP_K]: distinct visible entries (w < (t + 1) // rate) of each query in
    a random order, about a quarter of them replaced by -1, and -1 where fewer are visible — except that a
    query whose sequence already has entries it cannot see yet lists one of those too (the contract: a
    listed entry is attended only if visible; a kernel that trusts the list blindly reads it)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for seq_len, q_len, _ in seqs:
        for t in range(seq_len - q_len, seq_len):
            visible, total = (t + 1) // rate, seq_len // rate
            picks = torch.randperm(visible, generator=generator)[:TOP_K]
            picks = torch.where(torch.rand(len(picks), generator=generator) < 0.25, -1, picks)
            row = torch.cat([picks, torch.full((TOP_K - len(picks),), -1, dtype=torch.int64)])
            if total > visible:
                row[-1] = visible + int(torch.randint(total - visible, (1,), generator=generator))
            rows.append(row[torch.randperm(TOP_K, generator=generator)])
    return torch.stack(rows) if rows else torch.empty(0, TOP_K, dtype=torch.int64)


def attend(backend, seqs, mode, rate, q, window_entries, comp_entries, sinks, indices) -> torch.Tensor:
    """sparse_attention of `backend` over its own caches for this step; the result on CPU."""
    dtype, device = q.dtype, backend.torch_device
    step = Step(backend, seqs, seed=11)
    ring_spec = CacheSpec(CacheKind.SLIDING_WINDOW, dtype, 1, DIM, window=WINDOW, rollback_slots=ROLLBACK)
    kv = torch.cat([window_entries[b][first:] for b, first in enumerate(first_positions(seqs))])  # [T, D]
    kwargs = {}
    if mode is not None:
        comp_spec = CacheSpec(CacheKind.PAGED, dtype, 1, DIM, compress_rate=rate)
        kwargs = dict(compressed=step.compressed(comp_spec, comp_entries), compressed_spec=comp_spec)
        kwargs["indices"] = indices.to(device) if mode == "csa" else None
    out = backend.attention.sparse_attention(
        q.to(device),
        kv.to(device),
        step.ring(ring_spec, window_entries),
        ring_spec,
        step.meta,
        sinks=sinks.to(device),
        scale=DIM**-0.5,
        **kwargs,
    )
    return out.cpu()


@pytest.mark.parametrize("block_size", ["default", "smallest"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sparse_attention(suite, check, dtype, scenario, mode, block_size):
    suite.require("sparse_attention")
    kind, rate = MODES[mode]
    kinds = (CacheKind.SLIDING_WINDOW,) if kind is None else (CacheKind.SLIDING_WINDOW, CacheKind.PAGED)
    ours, ref = backends(suite, dtype, block_size, kinds, max(rate, 1))
    seqs = SCENARIOS[scenario]
    window_entries = [randn(seq_len, DIM, seed=100 + b, dtype=dtype) for b, (seq_len, _, _) in enumerate(seqs)]
    comp_entries = [
        randn(seq_len // rate if rate else 0, DIM, seed=200 + b, dtype=dtype) for b, (seq_len, _, _) in enumerate(seqs)
    ]
    tokens = sum(q_len for _, q_len, _ in seqs)
    q = randn(tokens, HEADS, DIM, seed=7, dtype=dtype)
    sinks = randn(HEADS, seed=8)  # float32: a sink logit per head joins every softmax
    indices = csa_indices(seqs, rate, seed=9) if kind == "csa" else None
    args = (seqs, kind, rate, q, window_entries, comp_entries, sinks, indices)
    actual, expected = attend(ours, *args), attend(ref, *args)
    assert actual.shape == (tokens, HEADS, DIM), f"output shape {tuple(actual.shape)}"
    assert actual.dtype == dtype, f"output dtype {actual.dtype}, expected q.dtype {dtype}"
    # each output averages up to WINDOW window entries plus the sequence's visible compressed entries
    longest = WINDOW + max((seq_len // rate if rate else 0) for seq_len, q_len, _ in seqs if q_len)
    magnitude = max(float(e.float().abs().max()) for e in window_entries + comp_entries if e.numel())
    check.close(
        actual,
        expected,
        dtype,
        reduce_dim=longest,
        magnitude=magnitude,
        what=f"sparse attention (block size {ours.kv_layout.block_size} vs {ref.kv_layout.block_size})",
    )


def indexer_inputs(seqs, rate: int, dtype: torch.dtype, scores: str):
    """(q [T, Hi, Di], weights [T, Hi], per-sequence keys [seq_len // rate, Di]).

    q and the keys share a large component along dim 0: every q . k is clearly positive ("distinct": all
    scores positive, no two equal), except for "dead" keys pointing the other way ("zero_ties": ReLU makes
    their scores exactly 0, and the contract breaks those ties by lower entry number; head 1's weight has a
    random sign there, so some scores are negative and rank below the zeros)."""
    axis = torch.zeros(INDEX_DIM)
    axis[0] = 3.0
    tokens = sum(q_len for _, q_len, _ in seqs)
    q = (axis + randn(tokens, INDEX_HEADS, INDEX_DIM, seed=30, scale=0.5)).to(dtype)
    weights = 0.5 + torch.rand(tokens, INDEX_HEADS, generator=torch.Generator().manual_seed(31))
    keys = []
    for b, (seq_len, _, _) in enumerate(seqs):
        count = seq_len // rate
        k = axis + randn(count, INDEX_DIM, seed=300 + b, scale=0.5)
        if scores == "zero_ties":
            dead = torch.rand(count, generator=torch.Generator().manual_seed(400 + b)) < 0.8
            k[dead, 0] = -3.0
        keys.append(k.to(dtype))
    if scores == "zero_ties":
        weights[:, 1] *= torch.randint(0, 2, (tokens,), generator=torch.Generator().manual_seed(32)) * 2 - 1
    return q, weights, keys


def pick(backend, seqs, rate, q, weights, keys) -> torch.Tensor:
    """indexer_topk of `backend` over its own PAGED cache of indexer keys; the result on CPU."""
    step = Step(backend, seqs, seed=13)
    spec = CacheSpec(CacheKind.PAGED, q.dtype, 1, INDEX_DIM, compress_rate=rate)
    device = backend.torch_device
    cache = step.compressed(spec, keys)
    out = backend.attention.indexer_topk(
        q.to(device), weights.to(device), cache, spec, step.meta, top_k=TOP_K, scale=INDEX_DIM**-0.5
    )
    return out.cpu()


@pytest.mark.parametrize("block_size", ["default", "smallest"])
@pytest.mark.parametrize("scores", ["distinct", "zero_ties"])
@pytest.mark.parametrize("rate", [4, 8])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_indexer_topk(suite, check, dtype, scenario, rate, scores, block_size):
    suite.require("indexer_topk")
    ours, ref = backends(suite, dtype, block_size, (CacheKind.PAGED,), rate)
    seqs = SCENARIOS[scenario]
    inputs = indexer_inputs(seqs, rate, dtype, scores)
    actual, expected = pick(ours, seqs, rate, *inputs), pick(ref, seqs, rate, *inputs)
    tokens = inputs[0].shape[0]
    assert actual.shape == (tokens, TOP_K) and actual.dtype == torch.int64, f"{tuple(actual.shape)}/{actual.dtype}"
    # the order of the picks is free: compare each query's sorted row (the -1 padding sorts first)
    visible = ((query_positions(seqs) + 1) // rate).clamp(max=TOP_K)
    assert torch.equal((expected >= 0).sum(dim=1), visible), "the reference picks min(top_k, visible) entries"
    check.equal(
        actual.sort(dim=1).values,
        expected.sort(dim=1).values,
        what=f"entries chosen per query (block size {ours.kv_layout.block_size} vs {ref.kv_layout.block_size})",
    )


V4_PROMPTS = (3, 17, 40, 77)  # shorter than the window, than an HCA entry (16), several of each
V4_NEW_TOKENS = 16


def test_v4_greedy_float32(suite, check, tiny_v4):
    """The engine on the tiny V4 checkpoint, in prefill chunks of at most 32 tokens with two sequence slots
    for five requests (a slot is reused with the previous request's ring and state in it). The fifth
    shares the fourth's first 64 tokens: a prefix hit at small block sizes, so it starts at window_starts
    > 0 (the bounded replay) with the slot's stale ring below it."""
    from deepinfer_core.engine.llm import LLM
    from deepinfer_core.sampling.params import SamplingParams

    for op in V4_OPS:  # the model calls every one (deepseek_v4.check_backend)
        suite.require(op)
    for kind in CacheKind:
        suite.require_declared("cache_kinds", kind, why="V4 caches need it")
    suite.require_dtype(torch.float32)
    sizes = [size for size in suite.capabilities.block_sizes if size % 16 == 0]  # the HCA rate divides them
    if not sizes:
        pytest.skip(f"no block size of {suite.under_test.name} ({suite.capabilities.block_sizes}) is a multiple of 16")
    ours = suite.resolved(suite.under_test, torch.float32, min(sizes))
    ref = suite.resolved(suite.reference, torch.float32)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in V4_PROMPTS]
    prompts.append(prompts[-1][:64] + torch.randint(2, 512, (13,), generator=g).tolist())
    params = SamplingParams(temperature=0, max_tokens=V4_NEW_TOKENS, ignore_eos=True, logprobs=20)

    def generate(backend):
        llm = LLM(
            model=tiny_v4,
            backend=backend,
            num_kv_blocks=-(-1024 // backend.kv_layout.block_size) + 8,
            max_num_seqs=2,
            max_num_batched_tokens=32,
            progress=False,
        )
        return llm.generate(prompts, params)

    outputs = generate(ours)
    got, want = [o.outputs[0] for o in outputs], [o.outputs[0] for o in generate(ref)]
    diverged, actual, expected = [], [], []
    for n, g, w in zip([len(p) for p in prompts], got, want):
        agree = next((i for i, (x, y) in enumerate(zip(g.token_ids, w.token_ids)) if x != y), V4_NEW_TOKENS)
        if agree < V4_NEW_TOKENS:
            diverged.append(f"{n}-token prompt at new token {agree} ({g.token_ids[agree]} vs {w.token_ids[agree]})")
        for mine, theirs in zip(g.top_logprobs[:agree], w.top_logprobs[:agree]):
            top = list(theirs.items())[:5]  # the reference's top 5, looked up in our top 20 (missing: NaN)
            actual += [mine.get(token, float("nan")) for token, _ in top]
            expected += [value for _, value in top]
    # logprobs come out of a log-softmax over the whole vocabulary: scale atol for that reduction
    check.close(torch.tensor(actual), torch.tensor(expected), torch.float32, reduce_dim=512, what="top logprobs")
    check.metric(  # keep the comparison's numbers; add how much of the fifth prompt came from the prefix cache
        max_abs_err=check.max_abs,
        max_rel_err=check.max_rel,
        tolerance=check.tolerance,
        prefix_hit_tokens=outputs[-1].num_cached_tokens,
    )
    assert not diverged, f"greedy tokens diverge from the reference: {'; '.join(diverged)}"
