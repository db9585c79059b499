"""Streaming detokenization: the deltas a request reports add up to its tokens decoded as a whole."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_core.engine.tokenizer import IncrementalDetokenizer, Tokenizer, demo_tokenizer_dir


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(demo_tokenizer_dir())


def streamed(detokenizer: IncrementalDetokenizer, ids: list[int], per_call: int) -> str:
    text = ""
    for end in range(per_call, len(ids) + per_call, per_call):
        text += detokenizer.update(ids[: min(end, len(ids))])
    return text


@settings(max_examples=200, deadline=None)
@given(data=st.data(), skip=st.booleans(), per_call=st.integers(1, 3))
def test_deltas_add_up_to_the_decoded_tokens(tokenizer, data, skip, per_call):
    """Any tokens (special ones, pieces of multi-byte characters), fed one or several at a time: the deltas are
    the whole decode, less a trailing incomplete character (held back, as the decode spells it U+FFFD)."""
    ids = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), min_size=1, max_size=40))
    detokenizer = IncrementalDetokenizer(tokenizer, skip)
    text = streamed(detokenizer, ids, per_call)
    whole = tokenizer.decode(ids, skip)
    assert text == detokenizer.text
    if whole.endswith("\ufffd"):
        assert whole.startswith(text)
    else:
        assert text == whole


def test_a_character_split_across_tokens_waits_for_its_last_byte(tokenizer):
    ids = tokenizer.encode("日本語のテキスト", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.update(ids[: n + 1]) for n in range(len(ids))]
    assert "".join(deltas) == "日本語のテキスト"
    assert all("\ufffd" not in delta for delta in deltas)


def test_special_tokens_are_skipped_or_kept_as_asked(tokenizer):
    eos = tokenizer.eos_token_id
    ids = [*tokenizer.encode("hello", add_special_tokens=False), eos]
    assert streamed(IncrementalDetokenizer(tokenizer, True), ids, 1) == "hello"
    assert streamed(IncrementalDetokenizer(tokenizer, False), ids, 1) == tokenizer.decode(ids, False) != "hello"


def test_a_shorter_list_starts_the_text_over(tokenizer):
    """A sequence whose tokens were cut (its output recomputed) is decoded again from the list it now has."""
    detokenizer = IncrementalDetokenizer(tokenizer)
    first = tokenizer.encode("one two three", add_special_tokens=False)
    detokenizer.update(first)
    second = tokenizer.encode("four", add_special_tokens=False)
    assert detokenizer.update(second) == "four" == detokenizer.text
