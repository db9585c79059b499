"""The front's routing (deepinfer_core/parallel/routing.py): the seeds' decode rule, and long prompts spread by
length bucket."""

from __future__ import annotations

import pytest

from deepinfer_core.parallel.routing import RankLoad, choose_rank, length_bucket


@pytest.mark.parametrize(
    ("tokens", "bucket"),
    [(0, 0), (16 * 1024 - 1, 0), (16 * 1024, 1), (64 * 1024 - 1, 1), (64 * 1024, 2), (256 * 1024, 3), (10**7, 3)],
)
def test_the_seeds_length_buckets(tokens, bucket):
    assert length_bucket(tokens) == bucket


def loads(*ranks: list[int]) -> list[RankLoad]:
    """One RankLoad per argument, holding requests of those prompt lengths."""
    out = []
    for rank, lengths in enumerate(ranks):
        load = RankLoad()
        for i, n in enumerate(lengths):
            load.add(f"{rank}-{i}", n)
        out.append(load)
    return out


def test_short_prompts_go_to_the_fewest_requests_then_the_least_kv():
    assert choose_rank(loads([10, 10], [10], [10, 10]), 50) == 1
    assert choose_rank(loads([500], [100], [300]), 50) == 1  # equal counts: the least KV
    assert choose_rank(loads([100], [100]), 50) == 0  # a tie: the lowest rank


def test_a_long_prompt_goes_where_its_bucket_is_emptiest_before_the_fewest_requests():
    # rank 0 holds one 100K prompt and nothing else; rank 1 two short ones: the decode rule alone would pick
    # rank 0 (fewer requests) and pile the long prefills up there
    ranks = loads([100_000], [10, 10])
    assert choose_rank(ranks, 90_000) == 1
    assert choose_rank(ranks, 20_000) == 0  # another bucket (16-64K): none on either, so the decode rule
    assert choose_rank(ranks, 10) == 0


def test_long_prompts_arriving_in_a_row_are_spread_over_every_rank():
    ranks = loads([], [], [], [])
    for i in range(8):
        ranks[choose_rank(ranks, 10)].add(f"short-{i}", 10)  # two short ones each
    chosen = []
    for i in range(8):
        rank = choose_rank(ranks, 300_000)
        ranks[rank].add(f"long-{i}", 300_000)
        chosen.append(rank)
    assert sorted(chosen) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_a_forgotten_request_no_longer_counts():
    ranks = loads([100_000, 10], [10])
    ranks[0].forget("0-0")
    assert ranks[0].num_requests == 1 and ranks[0].in_bucket(2) == 0 and ranks[0].kv_tokens == 10
    assert choose_rank(ranks, 100_000) == 0
