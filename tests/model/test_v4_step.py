"""V4Step.suffix: a step narrowed to a suffix of each sequence's tokens plans as one built from the narrowed
metadata, drops the sequences left with none, and masks the ring entries below each sequence's first kept
position."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.backend.ops import AttentionMetadata
from deepinfer_core.model.v4_step import V4Step

BLOCK = 8


def _step() -> V4Step:
    """Three sequences: positions 10..19 (cached prefix 8), 0..4, 30..37 (window_start 28)."""
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 10, 15, 23]),
        seq_lens=torch.tensor([20, 5, 38]),
        block_tables=torch.tensor([[3, 4, 5, -1, -1], [6, -1, -1, -1, -1], [7, 8, 9, 10, 11]]),
        slot_mapping=torch.arange(100, 123),
        seq_slots=torch.tensor([2, 0, 1]),
        window_starts=torch.tensor([0, 0, 28]),
        cached_lens=torch.tensor([8, 0, 0]),
        needed_from=torch.tensor([19, 4, 37]),
    )
    positions = torch.cat([torch.arange(10, 20), torch.arange(0, 5), torch.arange(30, 38)])
    return V4Step(meta, positions, BLOCK)


def _same_plans(got: V4Step, want: V4Step) -> None:
    for ring in (4, 16):
        assert all(torch.equal(a, b) for a, b in zip(got.ring_writes(ring), want.ring_writes(ring)))
    for rate in (1, 2, 4):
        mine, theirs = got.compress_plan(rate, False, rate + 3), want.compress_plan(rate, False, rate + 3)
        for field in mine.__slots__:
            a, b = getattr(mine, field), getattr(theirs, field)
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, (rate, field)


def test_a_suffix_keeps_each_sequences_last_tokens_and_drops_the_emptied_ones():
    step = _step()
    narrowed, rows = step.suffix([15, 9, 0])  # sequence 1 (positions 0..4) keeps nothing
    assert rows.tolist() == [5, 6, 7, 8, 9] + list(range(15, 23))
    meta = narrowed.meta
    assert meta.query_start_loc.tolist() == [0, 5, 13]
    assert meta.seq_lens.tolist() == [20, 38]
    assert meta.block_tables.tolist() == [[3, 4, 5, -1, -1], [7, 8, 9, 10, 11]]
    assert meta.slot_mapping.tolist() == [105, 106, 107, 108, 109] + list(range(115, 123))
    assert meta.seq_slots.tolist() == [2, 1]
    assert meta.window_starts.tolist() == [15, 28]  # raised to the first kept position, never lowered
    assert meta.cached_lens.tolist() == [8, 0] and meta.needed_from.tolist() == [19, 37]
    assert narrowed.positions.tolist() == list(range(15, 20)) + list(range(30, 38))
    _same_plans(narrowed, V4Step(meta, narrowed.positions, BLOCK))


def test_starts_follow_the_first_steps_sequences_through_repeated_narrowing():
    step, _ = _step().suffix([12, 5, 0])  # drops sequence 1: the next starts still index the first batch
    again, rows = step.suffix([17, 99, 35])
    assert again.origins == [0, 2]
    assert again.positions.tolist() == [17, 18, 19, 35, 36, 37]
    assert rows.tolist() == [5, 6, 7, 13, 14, 15]  # rows of `step`, not of the first batch
    assert again.meta.window_starts.tolist() == [17, 35]


def test_keeping_everything_is_the_same_step_and_keeping_nothing_an_empty_one():
    step = _step()
    assert step.suffix([0, 0, 30]) == (step, None)
    empty, rows = step.suffix([20, 5, 38])
    assert empty.num_tokens == 0 and rows.numel() == 0 and empty.meta.num_seqs == 0


def _decode_meta(max_query_len: int | None) -> tuple[AttentionMetadata, torch.Tensor]:
    """Four sequences, one token each, at positions 7, 12, 0, 35 (the first and last finish a window of 4
    and of 8; 12 starts one; 0 is a sequence's first token)."""
    positions = torch.tensor([7, 12, 0, 35])
    meta = AttentionMetadata(
        query_start_loc=torch.arange(5),
        seq_lens=positions + 1,
        block_tables=torch.tensor([[3, -1, -1, -1, -1], [4, 5, -1, -1, -1], [6, -1, -1, -1, -1], [7, 8, 9, 10, 11]]),
        slot_mapping=torch.arange(4),
        seq_slots=torch.tensor([2, 0, 3, 1]),
        window_starts=torch.zeros(4, dtype=torch.int64),
        cached_lens=torch.tensor([0, 8, 0, 0]),
        max_query_len=max_query_len,
    )
    return meta, positions


def test_a_decode_step_is_planned_on_the_device_as_the_host_plans_the_windows_it_finishes():
    """max_query_len 1: every sequence's window gets an entry (finished or not) and no host list is read;
    the finished windows' entries, the state writes and the ring writes are the host plan's."""
    device_step, host_step = (V4Step(*_decode_meta(n), BLOCK) for n in (1, None))
    assert device_step.decode and not host_step.decode
    for ring in (4, 16):
        assert all(torch.equal(a, b) for a, b in zip(device_step.ring_writes(ring), host_step.ring_writes(ring)))
    for rate, overlap in ((4, True), (4, False), (8, False), (1, False), (2, True)):
        rows = (2 * rate if overlap else rate) + 3
        mine, theirs = device_step.compress_plan(rate, overlap, rows), host_step.compress_plan(rate, overlap, rows)
        assert mine.num_entries == 4
        finished = ((torch.tensor([7, 12, 0, 35]) + 1) % rate == 0).nonzero()[:, 0]
        assert theirs.num_entries == len(finished), (rate, overlap)
        for field in ("positions", "slots"):
            assert torch.equal(getattr(mine, field)[finished], getattr(theirs, field)), (rate, overlap, field)
        assert torch.equal(mine.valid[finished], theirs.valid), (rate, overlap)
        assert torch.equal(mine.sources[finished][theirs.valid], theirs.sources[theirs.valid]), (rate, overlap)
        want = sorted(zip(theirs.state_seqs.tolist(), theirs.state_rows.tolist(), theirs.state_tokens.tolist()))
        got = sorted(zip(mine.state_seqs.tolist(), mine.state_rows.tolist(), mine.state_tokens.tolist()))
        assert got == want, (rate, overlap)
        # an unfinished window's entry sits in its own slot (the window of its token), invisible until it ends
        window = torch.tensor([7, 12, 0, 35]) // rate
        assert torch.equal(mine.positions, window * rate)
    assert device_step._host_lists is None, "a decode step read the metadata on the host"


def test_the_engram_look_back_of_a_decode_step_is_the_host_plans():
    """NgramHasher's look-back sources and state writes, planned on the device for a decode step, equal the
    host plan's, including the stale state entries before a sequence's window start (source -1)."""
    from deepinfer_core.model.v41_engram import NgramHasher

    hasher = NgramHasher.__new__(NgramHasher)  # the plan needs only the look-back length
    hasher.lookback, hasher.span, hasher.rows = 3, 4, 10
    metas = [_decode_meta(n) for n in (1, None)]
    for meta, _ in metas:
        meta.window_starts.copy_(torch.tensor([6, 0, 0, 34]))  # 6 and 34: shifts past them are stale
    device_step, host_step = (V4Step(meta, positions, BLOCK) for meta, positions in metas)
    got, want = hasher._lookback_sources(device_step), hasher._lookback_sources(host_step)
    assert torch.equal(got[0], want[0])
    assert sorted(map(tuple, got[1].T.tolist())) == sorted(map(tuple, want[1].T.tolist()))
    assert (got[0] == -1).any(), "no stale or pre-start look-back in the case"
    assert device_step._host_lists is None


def _verify_meta(uniform: bool) -> tuple[AttentionMetadata, torch.Tensor]:
    """Four sequences verifying three tokens each (a token and two drafts) at positions 5..7, 10..12, 0..2 and
    33..35: windows of 4 and 8 finish inside the step, at its last token or before it, or not at all."""
    firsts = torch.tensor([5, 10, 0, 33])
    positions = (firsts[:, None] + torch.arange(3)).flatten()
    meta = AttentionMetadata(
        query_start_loc=torch.arange(5) * 3,
        seq_lens=firsts + 3,
        block_tables=torch.tensor([[3, -1, -1, -1, -1], [4, 5, -1, -1, -1], [6, -1, -1, -1, -1], [7, 8, 9, 10, 11]]),
        slot_mapping=torch.arange(12),
        seq_slots=torch.tensor([2, 0, 3, 1]),
        window_starts=torch.tensor([4, 0, 0, 34]),
        cached_lens=torch.tensor([0, 8, 0, 0]),
        max_query_len=3,
        uniform_decode=uniform,
    )
    return meta, positions


def test_a_uniform_verify_step_is_planned_on_the_device_as_the_host_plans_it():
    """uniform_decode, three tokens a sequence: each window a token falls in gets an entry (finished or not)
    and every token of one window writes the newest's; the finished windows' entries (their sources), the state,
    ring and engram writes are the host plan's, and no host list is read."""
    from deepinfer_core.model.v41_engram import NgramHasher

    device_step, host_step = (V4Step(*_verify_meta(u), BLOCK) for u in (True, False))
    assert device_step.decode and not host_step.decode
    positions = device_step.positions
    for ring in (4, 16):
        got, want = device_step.ring_writes(ring), host_step.ring_writes(ring)
        assert sorted(zip(*(t.tolist() for t in got))) == sorted(zip(*(t.tolist() for t in want))), ring
    for rate, overlap in ((4, True), (4, False), (8, False), (1, False), (2, True)):
        rows = (2 * rate if overlap else rate) + 6
        mine, theirs = device_step.compress_plan(rate, overlap, rows), host_step.compress_plan(rate, overlap, rows)
        assert mine.num_entries == 12
        written = mine.written if mine.written is not None else torch.arange(12)
        if rate > 1:
            assert mine.written is not None
        # what lands in each slot: the entry of the newest token of the step in that window
        for token in range(12):
            newest = written[token]
            same_window = (positions // rate == positions[token] // rate) & (torch.arange(12) // 3 == token // 3)
            assert newest == same_window.nonzero().max(), (rate, overlap, token)
            assert mine.slots[newest] == mine.slots[token]
        for e in range(theirs.num_entries):  # each finished window: the host's entry is what the device writes
            token = (mine.slots == theirs.slots[e]).nonzero()[0, 0]
            source = written[token]
            assert mine.positions[source] == theirs.positions[e]
            assert torch.equal(mine.valid[source], theirs.valid[e]), (rate, overlap, e)
            assert torch.equal(mine.sources[source][theirs.valid[e]], theirs.sources[e][theirs.valid[e]])
        assert set(mine.slots.tolist()) >= set(theirs.slots.tolist())
        want = sorted(zip(theirs.state_seqs.tolist(), theirs.state_rows.tolist(), theirs.state_tokens.tolist()))
        got = sorted(zip(mine.state_seqs.tolist(), mine.state_rows.tolist(), mine.state_tokens.tolist()))
        assert got == want, (rate, overlap)
    hasher = NgramHasher.__new__(NgramHasher)  # the look-back plan needs only its lengths
    hasher.lookback, hasher.span, hasher.rows = 3, 4, 10
    got, want = hasher._lookback_sources(device_step), hasher._lookback_sources(host_step)
    assert torch.equal(got[0], want[0])
    assert sorted(map(tuple, got[1].T.tolist())) == sorted(map(tuple, want[1].T.tolist()))
    assert device_step._host_lists is None, "a uniform step read the metadata on the host"


def test_a_uniform_step_must_hold_max_query_len_tokens_a_sequence():
    meta, positions = _verify_meta(True)
    with pytest.raises(ValueError, match="max_query_len tokens for each of its 4 sequences"):
        V4Step(meta, positions[:-1], BLOCK)
