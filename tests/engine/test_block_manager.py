"""BlockManager (block ids, reference counts, prefix caching, LRU eviction) and Scheduler (token budget,
chunked prefill, preemption), driven with hand-made Requests and a simulated engine step."""

from __future__ import annotations

import itertools

import pytest

from deepinfer_core.engine.block_manager import (
    BOUNDED_REPLAY_TOKENS,
    BlockManager,
    check_prefix_replay,
    hash_block,
    prefix_replay_tokens,
)
from deepinfer_core.engine.cost import LinearCostModel
from deepinfer_core.engine.request import Request, RequestStatus
from deepinfer_core.engine.scheduler import Scheduler, SchedulerConfig
from deepinfer_core.errors import DeepInferError
from deepinfer_core.sampling.params import SamplingParams

BS = 4  # tokens per block
_ids = itertools.count()


def req(tokens, arrival: int | None = None) -> Request:
    n = next(_ids)
    return Request(
        request_id=f"r{n}",
        prompt=None,
        prompt_token_ids=list(tokens),
        params=SamplingParams(),
        seed=0,
        arrival=n if arrival is None else arrival,
    )


def computed(bm: BlockManager, request: Request, num_tokens: int | None = None) -> None:
    """What the engine does after a step: the tokens are in the cache, full blocks get registered."""
    request.num_computed_tokens = request.num_tokens if num_tokens is None else num_tokens
    bm.cache_full_blocks(request)


def admitted(bm: BlockManager, tokens, arrival=None) -> Request:
    """A request admitted for its whole (uncached) prompt and fully computed."""
    r = req(tokens, arrival)
    assert bm.admit(r, r.num_tokens - bm.cached_prefix_tokens(r))
    computed(bm, r)
    return r


def refs(bm: BlockManager, block_id: int) -> int:
    return bm._blocks[block_id].ref_count


A = list(range(100, 109))  # 9 tokens: two full blocks + one token
B = list(range(200, 209))


# ---- BlockManager -------------------------------------------------------------------------------


def test_hash_block_chain():
    root = hash_block(None, [1, 2, 3, 4])
    assert root == hash_block(None, [1, 2, 3, 4])  # deterministic
    assert len(root) == 16
    assert root != hash_block(None, [1, 2, 3, 5])
    assert root != hash_block(None, [4, 3, 2, 1])
    other_parent = hash_block(None, [9, 9, 9, 9])
    assert hash_block(root, [5, 6, 7, 8]) != hash_block(other_parent, [5, 6, 7, 8])
    assert hash_block(root, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])


def test_same_block_under_a_different_parent_is_not_a_hit():
    """X Y cached, Z cached: a request Z Y ... finds Z but not Y (Y's hash depends on its parent)."""
    bm = BlockManager(num_blocks=16, block_size=BS)
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    admitted(bm, x + y + [0])
    admitted(bm, z + [0])
    probe = req(z + y + [0])
    assert bm.cached_prefix_tokens(probe) == BS
    assert bm.cached_prefix_tokens(req(x + y + [0])) == 2 * BS


def test_admit_reuses_cached_full_blocks():
    bm = BlockManager(num_blocks=16, block_size=BS)
    first = admitted(bm, A)
    assert len(first.block_ids) == 3 and len(first.block_hashes) == 2
    bm.free(first)
    r = req(A + [7, 7, 7])  # 12 tokens: 2 cached blocks, then a third block of new tokens
    assert bm.cached_prefix_tokens(r) == 2 * BS
    assert bm.admit(r, r.num_tokens - 2 * BS)
    assert r.block_ids[:2] == first_blocks(first, bm, A)
    assert r.num_computed_tokens == r.num_cached_tokens == 2 * BS
    assert r.block_hashes == [hash_block(None, A[:4]), hash_block(hash_block(None, A[:4]), A[4:8])]
    assert len(r.block_ids) == 3 and r.block_ids[2] not in r.block_ids[:2]
    assert (bm.prefix_queries, bm.prefix_hits) == (9 + 12, 8)


def first_blocks(first: Request, bm: BlockManager, tokens) -> list[int]:
    """Block ids holding `tokens`' cached full blocks (read through the cache index)."""
    h0 = hash_block(None, tokens[:4])
    return [bm._cached[h0], bm._cached[hash_block(h0, tokens[4:8])]]


def test_block_holding_the_last_token_is_never_reused():
    bm = BlockManager(num_blocks=16, block_size=BS)
    first = admitted(bm, A[:8])  # exactly two full blocks, both cached
    assert len(first.block_hashes) == 2
    bm.free(first)
    same = req(A[:8])
    assert bm.cached_prefix_tokens(same) == BS  # the second block holds the last token
    assert bm.admit(same, 4)
    assert same.num_computed_tokens == BS and len(same.block_ids) == 2
    assert bm.cached_prefix_tokens(req(A[:5])) == BS
    assert bm.cached_prefix_tokens(req(A[:4])) == 0  # a single-block prompt computes its block


def test_shared_prefix_reference_counts():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = admitted(bm, A)  # 3 blocks
    assert bm.num_free_blocks == 5
    b = req(A[:8] + [55, 56])
    assert bm.admit(b, 2)  # shares a's two full blocks, one new block
    assert b.block_ids[:2] == a.block_ids[:2]
    assert [refs(bm, i) for i in a.block_ids] == [2, 2, 1]
    assert bm.num_free_blocks == 4 and bm.num_used_blocks == 4
    bm.free(a)
    assert a.block_ids == [] and a.block_hashes == []
    assert [refs(bm, i) for i in b.block_ids] == [1, 1, 1]
    assert bm.num_free_blocks == 5  # only a's private tail block came back
    bm.free(b)
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0


def test_admitting_a_hit_on_a_free_block_takes_it_out_of_the_free_list():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = admitted(bm, A)
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = req(A)
    assert bm.admit(b, 1)
    assert bm.num_free_blocks == 1 and [refs(bm, i) for i in b.block_ids] == [1, 1, 1]
    # the remaining free block is handed out; the shared ones are not
    c = req([1, 2, 3])
    assert bm.admit(c, 3) and c.block_ids[0] not in b.block_ids
    assert not bm.admit(req([4]), 1)


def test_freed_cached_blocks_stay_findable_until_evicted():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = admitted(bm, A)  # all three blocks: two cached + one partial
    bm.free(a)
    assert bm.num_free_blocks == 3
    assert bm.cached_prefix_tokens(req(A)) == 2 * BS
    filler = req(list(range(12)))
    assert bm.admit(filler, 4)  # takes A's partial block first (no hash)
    assert bm.cached_prefix_tokens(req(A)) == 2 * BS
    assert bm.grow(filler, 8)  # next: A's tail cached block (freed first, so evicted first)
    assert bm.cached_prefix_tokens(req(A)) == BS
    assert bm.grow(filler, 12)
    assert bm.cached_prefix_tokens(req(A)) == 0


def test_eviction_order_unhashed_first_then_least_recently_freed():
    bm = BlockManager(num_blocks=6, block_size=BS)
    a, b = admitted(bm, A), admitted(bm, B)
    a_blocks, b_blocks = list(a.block_ids), list(b.block_ids)
    assert bm.num_free_blocks == 0
    bm.free(a)
    bm.free(b)
    order = []
    c = req(list(range(300, 324)))
    assert bm.admit(c, 4)
    order.append(c.block_ids[-1])
    for n in range(8, 25, 4):
        assert bm.grow(c, n)
        order.append(c.block_ids[-1])
    # unhashed tails (most recently freed first), then a's tail-to-head, then b's tail-to-head
    assert order == [b_blocks[2], a_blocks[2], a_blocks[1], a_blocks[0], b_blocks[1], b_blocks[0]]


def test_eviction_tracks_the_last_free_not_the_first_allocation():
    """A cached block reused (and freed again) moves behind blocks freed before its reuse."""
    bm = BlockManager(num_blocks=6, block_size=BS)
    a, b = admitted(bm, A), admitted(bm, B)
    bm.free(a)
    bm.free(b)
    again = req(A)
    assert bm.admit(again, 1)  # reuses a's two cached blocks (and takes one unhashed block)
    bm.free(again)
    # now b's cached blocks are the least recently freed: evicted before a's
    c = req(list(range(300, 316)))
    assert bm.admit(c, 16)  # four blocks: the two unhashed ones, then b's two cached blocks
    assert bm.cached_prefix_tokens(req(B)) == 0
    assert bm.cached_prefix_tokens(req(A)) == 2 * BS


def test_eviction_drops_the_hash_from_the_cache():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = admitted(bm, A)
    bm.free(a)
    c = req(list(range(50, 62)))
    assert bm.admit(c, 12)  # takes all three blocks, evicting A's two cached ones
    assert bm.cached_prefix_tokens(req(A)) == 0
    assert bm._cached == {} and all(bm._blocks[i].hash is None for i in c.block_ids)
    computed(bm, c)  # c's own three full blocks replace them
    assert sorted(bm._cached.values()) == sorted(c.block_ids)
    assert hash_block(None, A[:4]) not in bm._cached


def test_grow_fails_without_changing_state():
    bm = BlockManager(num_blocks=3, block_size=BS)
    r = req(list(range(8)))
    assert bm.admit(r, 8)
    before = list(r.block_ids)
    assert bm.num_free_blocks == 1
    assert not bm.grow(r, 13)  # needs two more blocks, one is free
    assert r.block_ids == before and bm.num_free_blocks == 1
    assert bm.grow(r, 8) and r.block_ids == before  # already covered
    assert bm.grow(r, 12) and len(r.block_ids) == 3 and bm.num_free_blocks == 0
    assert not bm.grow(r, 13) and len(r.block_ids) == 3


def test_admit_is_all_or_nothing():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = admitted(bm, A)  # 3 blocks: two cached
    bm.free(a)
    hog = req([1])
    assert bm.admit(hog, 1)  # takes the unhashed block
    big = req(A[:8] + list(range(20)))  # 2 cached blocks + 20 new tokens: 5 more blocks, 1 free
    assert not bm.admit(big, 20)
    assert big.block_ids == [] and big.num_computed_tokens == 0
    assert bm.num_free_blocks == 3  # the cached hits were not taken
    assert bm.prefix_queries == 9 + 1  # a failed admission is not counted
    assert bm.admit(req(A), 1)  # the cached prefix is still there


def test_cache_full_blocks_registers_each_block_once():
    bm = BlockManager(num_blocks=8, block_size=BS)
    r = req(list(range(10)))
    assert bm.admit(r, 10)
    computed(bm, r, 6)  # one full block
    assert len(r.block_hashes) == 1
    first_hash = r.block_hashes[0]
    bm.cache_full_blocks(r)  # again, nothing new
    assert r.block_hashes == [first_hash]
    computed(bm, r, 10)
    assert len(r.block_hashes) == 2 and r.block_hashes[0] == first_hash
    assert r.block_hashes[1] == hash_block(first_hash, list(range(4, 8)))
    assert bm._cached == {first_hash: r.block_ids[0], r.block_hashes[1]: r.block_ids[1]}


def test_identical_block_computed_twice_keeps_the_first_cached():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = req(A), req(A)
    assert bm.admit(a, 9) and bm.admit(b, 9)  # neither is cached yet: separate blocks
    assert set(a.block_ids).isdisjoint(b.block_ids)
    computed(bm, a)
    computed(bm, b)
    assert b.block_hashes == a.block_hashes
    assert sorted(bm._cached.values()) == sorted(a.block_ids[:2])
    b_blocks = list(b.block_ids)
    bm.free(b)  # b's duplicates carry no hash: they go to the front, to be handed out first
    c = req([1, 2])
    assert bm.admit(c, 2) and c.block_ids[0] in b_blocks
    assert bm.cached_prefix_tokens(req(A)) == 2 * BS
    probe = req(A)
    assert bm.admit(probe, 1) and probe.block_ids[:2] == a.block_ids[:2]


def test_prefix_caching_disabled():
    bm = BlockManager(num_blocks=6, block_size=BS, enable_prefix_caching=False)
    a = req(A)
    assert bm.admit(a, 9)
    computed(bm, a)
    assert a.block_hashes == [] and bm._cached == {}
    bm.free(a)
    assert bm.num_free_blocks == 6
    again = req(A)
    assert bm.cached_prefix_tokens(again) == 0
    assert bm.admit(again, 9)
    assert again.num_computed_tokens == again.num_cached_tokens == 0 and len(again.block_ids) == 3
    assert bm.prefix_hits == 0


@pytest.mark.parametrize(("exact", "bounded"), [(0, 0), (28, 28), (128, 128), (5080, BOUNDED_REPLAY_TOKENS)])
def test_bounded_replay_is_the_models_exact_replay_capped_at_one_block(exact, bounded):
    assert prefix_replay_tokens("exact", exact) == exact  # 0: a model without per-sequence caches (V3)
    assert prefix_replay_tokens("bounded", exact) == bounded


def test_a_hit_starts_computing_replay_tokens_before_its_end():
    bm = BlockManager(num_blocks=16, block_size=BS, replay_tokens=prefix_replay_tokens("bounded", 5))
    admitted(bm, A + B)  # 18 tokens: 4 full blocks
    again = req(A + B[:7] + [1])
    assert bm.cached_prefix_tokens(again) == 16 - 5
    assert bm.admit(again, 2 + 5)
    assert again.num_cached_tokens == 16 and again.num_computed_tokens == again.window_start == 11


def test_an_unknown_prefix_replay_says_what_each_choice_does():
    assert check_prefix_replay("bounded") == "bounded"
    with pytest.raises(DeepInferError, match=r"'exact' \(a prefix hit recomputes every token .* 'bounded' \(only"):
        check_prefix_replay("Exact")


# ---- Scheduler ----------------------------------------------------------------------------------


def scheduler(
    num_blocks: int = 64,
    chunk: int = 10_000,
    max_tokens: int = 2048,
    max_seqs: int = 64,
    prefix_caching: bool = True,
) -> Scheduler:
    """Cost = 1 s per token, so a step budget of `chunk` seconds caps a prefill chunk at `chunk` tokens."""
    cost = LinearCostModel(fixed_s=0.0, per_token_s=1.0, per_attended_s=0.0)
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens, step_budget_s=float(chunk))
    return Scheduler(config, BlockManager(num_blocks, BS, prefix_caching), cost)


def run_step(s: Scheduler):
    """Schedule and apply one step the way the engine does; a request reaching its end gets a token."""
    step = s.schedule()
    for request, count in step.requests:
        assert request.num_computed_tokens + count <= request.num_tokens
        assert len(request.block_ids) * BS >= request.num_computed_tokens + count  # blocks cover the step
        request.num_computed_tokens += count
        s.blocks.cache_full_blocks(request)
        if request.num_computed_tokens == request.num_tokens:
            request.output_token_ids.append(900 + len(request.output_token_ids))
    return step


def counts(step) -> dict[str, int]:
    return {r.request_id: n for r, n in step.requests}


def test_token_budget_is_respected():
    s = scheduler(max_tokens=10)
    a, b, c = req(range(6)), req(range(10, 16)), req(range(20, 26))
    for r in (a, b, c):
        s.add(r)
    step = run_step(s)
    assert counts(step) == {a.request_id: 6, b.request_id: 4}  # c: no budget left
    assert list(s.waiting) == [c] and step.num_tokens == 10
    step = run_step(s)
    assert counts(step) == {a.request_id: 1, b.request_id: 2, c.request_id: 6}
    for _ in range(20):
        step = run_step(s)
        assert step.num_tokens <= 10
    assert step.num_tokens == 3  # three decodes


def test_chunked_prefill_chunks_sum_to_the_prompt_then_decode_is_one_token():
    s = scheduler(chunk=5)
    r = req(range(23))
    s.add(r)
    chunks = []
    while r.num_computed_tokens < 23:
        chunks.append(counts(run_step(s))[r.request_id])
    assert chunks == [5, 5, 5, 5, 3] and sum(chunks) == 23
    assert r.output_token_ids == [900]
    for _ in range(3):
        assert counts(run_step(s)) == {r.request_id: 1}
    assert len(r.output_token_ids) == 4 and r.num_computed_tokens == 26


def test_chunk_follows_the_cost_model():
    """With attention cost, a chunk shrinks as the context grows."""
    cost = LinearCostModel(fixed_s=0.0, per_token_s=1.0, per_attended_s=0.125)
    s = Scheduler(SchedulerConfig(step_budget_s=20.0), BlockManager(64, BS), cost)
    r = req(range(100))
    s.add(r)
    first = counts(run_step(s))[r.request_id]  # q + q * q / 8 <= 20: q = 9
    second = counts(run_step(s))[r.request_id]  # q + q * (9 + q) / 8 <= 20: q = 6
    assert (first, second) == (9, 6)


def test_prefix_hit_shortens_the_first_chunk():
    s = scheduler()
    first = req(range(23))
    s.add(first)
    run_step(s)
    s.finish(first)
    second = req(range(23))
    s.add(second)
    step = run_step(s)
    assert counts(step) == {second.request_id: 3}  # 20 tokens (5 full blocks) came from the cache
    assert second.num_cached_tokens == 20 and second.num_computed_tokens == 23


def test_preemption_takes_the_latest_arrival_and_requeues_it_first():
    s = scheduler(num_blocks=3, prefix_caching=False)
    a, b, c = req(range(4)), req(range(10, 14)), req(range(20, 24))
    for r in (a, b, c):
        s.add(r)
    step = run_step(s)
    assert step.num_preempted == 0 and step.num_tokens == 12 and s.blocks.num_free_blocks == 0
    late = req([77])
    s.add(late)
    # every request now needs a second block; none is free
    step = run_step(s)
    assert counts(step) == {a.request_id: 1}
    assert step.num_preempted == 2
    assert s.running == [a]
    assert list(s.waiting) == [b, c, late]  # victims in front, in arrival order
    for victim in (b, c):
        assert victim.status is RequestStatus.WAITING
        assert victim.num_computed_tokens == 0 and victim.block_ids == []
        assert victim.num_preemptions == 1
        assert victim.output_token_ids == [900]  # generated tokens are kept, to be recomputed
    assert len(a.block_ids) == 2 and s.blocks.num_free_blocks == 1


def test_preempting_another_request_lets_the_earlier_one_grow():
    s = scheduler(num_blocks=4, prefix_caching=False)
    a, b = req(range(8)), req(range(10, 18))
    s.add(a)
    s.add(b)
    run_step(s)  # 2 blocks each, cache full
    step = run_step(s)
    assert counts(step) == {a.request_id: 1} and step.num_preempted == 1
    assert list(s.waiting) == [b] and b.num_computed_tokens == 0


def test_no_admission_in_a_step_that_preempted():
    s = scheduler(num_blocks=4, chunk=4, prefix_caching=False)
    a, b = req(range(4)), req(range(10, 18))
    s.add(a)
    s.add(b)
    assert counts(run_step(s)) == {a.request_id: 4, b.request_id: 4}
    assert counts(run_step(s)) == {a.request_id: 1, b.request_id: 4}
    assert s.blocks.num_free_blocks == 0
    small = req([5, 6])
    s.add(small)
    # b (9 tokens) needs a third block: it is preempted; its 2 freed blocks would fit both b's first
    # chunk and `small`, but nothing is admitted in this step
    step = run_step(s)
    assert counts(step) == {a.request_id: 1} and step.num_preempted == 1
    assert list(s.waiting) == [b, small] and s.blocks.num_free_blocks == 2
    step = run_step(s)  # next step: admission resumes, b first
    assert step.num_preempted == 0
    assert counts(step) == {a.request_id: 1, b.request_id: 4, small.request_id: 2}
    assert s.running == [a, b, small] and not s.waiting


def test_readmitted_request_resumes_from_prefix_cache():
    s = scheduler(num_blocks=5)
    a, b = req(range(8)), req(range(10, 18))
    s.add(a)
    s.add(b)
    run_step(s)
    step = run_step(s)  # a takes the last free block; b cannot grow and is preempted
    assert counts(step) == {a.request_id: 1} and step.num_preempted == 1
    # b's two full blocks stay cached
    assert list(s.waiting) == [b]
    s.finish(a)
    step = run_step(s)
    assert counts(step) == {b.request_id: 1}  # 9 tokens: 8 from the cache
    assert b.num_cached_tokens == 8 and b.num_tokens == 10


def test_max_num_seqs():
    s = scheduler(max_seqs=2)
    rs = [req(range(i * 10, i * 10 + 3)) for i in range(3)]
    for r in rs:
        s.add(r)
    step = run_step(s)
    assert [r for r, _ in step.requests] == rs[:2] and list(s.waiting) == [rs[2]]
    assert len(run_step(s).requests) == 2 and list(s.waiting) == [rs[2]]
    s.finish(rs[0])
    assert rs[0].status is RequestStatus.FINISHED
    step = run_step(s)
    assert counts(step) == {rs[1].request_id: 1, rs[2].request_id: 3}


def test_running_requests_come_first_in_arrival_order():
    s = scheduler(num_blocks=64)
    late, early = req(range(5), arrival=5), req(range(10, 15), arrival=1)
    s.add(late)
    s.add(early)
    run_step(s)
    assert s.running == [early, late]
    newcomer = req([1, 2], arrival=9)
    s.add(newcomer)
    step = run_step(s)
    assert [r for r, _ in step.requests] == [early, late, newcomer]


def test_finish_frees_blocks():
    s = scheduler(num_blocks=8)
    a, b = req(range(9)), req(range(20, 25))
    s.add(a)
    s.add(b)
    run_step(s)
    assert s.blocks.num_free_blocks == 8 - 3 - 2
    s.finish(a)
    assert a.status is RequestStatus.FINISHED and a.block_ids == []
    assert s.running == [b] and s.blocks.num_free_blocks == 6
    waiting = req(range(40, 60))
    s.add(waiting)
    s.finish(waiting)  # a waiting request can be finished (aborted) too
    assert not s.waiting and waiting.status is RequestStatus.FINISHED
    s.finish(b)
    assert s.blocks.num_free_blocks == 8 and not s.has_unfinished()


def test_full_run_conserves_blocks():
    """Many requests through a small cache: every step within budget, no block leaked."""
    s = scheduler(num_blocks=12, chunk=6, max_tokens=16, max_seqs=4)
    rs = [req([i % 7] * 5 + list(range(i, i + 6 + i % 5))) for i in range(8)]
    for r in rs:
        s.add(r)
    done = []
    for _ in range(500):
        if not s.has_unfinished():
            break
        step = run_step(s)
        assert step.num_tokens <= 16 and len(step.requests) <= 4
        used = sum(len(r.block_ids) for r in s.running)
        assert s.blocks.num_used_blocks <= used  # shared prefix blocks count once
        for r in list(s.running):
            if len(r.output_token_ids) >= 6:
                s.finish(r)
                done.append(r)
    assert len(done) == 8 and not s.has_unfinished()
    assert s.blocks.num_free_blocks == 12
    assert all(r.output_token_ids == [900 + i for i in range(6)] for r in rs)
    assert any(r.num_preemptions for r in rs)  # the cache was small enough to force preemption


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_decode_steps_grow_blocks_at_block_boundaries(prefix_caching):
    s = scheduler(prefix_caching=prefix_caching)
    r = req(range(3))
    s.add(r)
    sizes = []
    for _ in range(7):
        run_step(s)
        sizes.append(len(r.block_ids))
    # tokens covered after each step: 3, 4, 5, ..., 9
    assert sizes == [1, 1, 2, 2, 2, 2, 3]
