"""The data-parallel front's record of what it passed on (parallel/deliveries.py): a request recomputed after a
lost rank reports its tokens again from the first; only what is new is passed on, and a recomputation that
diverges is refused."""

from __future__ import annotations

import pytest

from deepinfer_core.engine.request import CompletionOutput, RequestOutput
from deepinfer_core.parallel.deliveries import Deliveries, DivergedRecomputation


def report(tokens: tuple[int, ...], new: int, finished: bool = False) -> RequestOutput:
    """A report of sample 0 with `tokens` so far, the last `new` of them new (one character per token)."""
    text = "".join(chr(97 + t) for t in tokens)
    sample = CompletionOutput(
        text=text, token_ids=tokens, token_logprobs=None, top_logprobs=None,
        finish_reason="length" if finished else None, stop_reason=None,
        new_text=text[len(text) - new :], new_token_ids=tokens[len(tokens) - new :],
    )  # fmt: skip
    return RequestOutput("r", None, (1, 2), [sample], finished, 0)


def test_a_recomputed_request_passes_on_only_what_is_new():
    deliveries = Deliveries()
    assert deliveries.new_part(report((1, 2), 2)).new_token_ids == (1, 2)
    # restarted: the request reports from its first token again
    assert deliveries.new_part(report((1,), 1)) is None
    assert deliveries.new_part(report((1, 2), 1)) is None
    again = deliveries.new_part(report((1, 2, 3, 4), 2))
    assert again.new_token_ids == (3, 4) and again.outputs[0].new_text == "de"
    last = deliveries.new_part(report((1, 2, 3, 4, 5), 1, finished=True))
    assert last.new_token_ids == (5,) and last.finished


def test_a_recomputation_that_diverges_is_refused():
    deliveries = Deliveries()
    deliveries.new_part(report((1, 2, 3), 3))
    with pytest.raises(DivergedRecomputation):
        deliveries.new_part(report((1, 7), 1))
