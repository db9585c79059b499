"""A rank's requests with a structured-output grammar wait for it off the rank's loop (parallel/rank_admission.py):
admitted once compiled, refused with the compiler's reason, forgotten when aborted."""

from __future__ import annotations

import time

import pytest

from deepinfer import LLM, SamplingParams, StructuredOutputsParams
from deepinfer_core.parallel.rank_admission import GrammarAdmission


@pytest.fixture(scope="module")
def engine():
    return LLM(accelerator="cpu", max_num_seqs=4, progress=False).engine


def admitted(admission: GrammarAdmission, timeout_s: float = 60.0) -> list[tuple[str, str]]:
    refused, deadline = [], time.monotonic() + timeout_s
    while len(admission) and time.monotonic() < deadline:
        refused += admission.admit()
        time.sleep(0.01)
    assert not len(admission), "a grammar did not compile in time"
    return refused


def test_held_requests_are_admitted_once_compiled_or_refused_with_the_reason(engine):
    admission = GrammarAdmission(engine)
    plain = SamplingParams(max_tokens=2)
    assert not admission.needs(plain)
    good = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    bad = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="[a-z"))
    admission.hold("good", [5, 6, 7], good)
    admission.hold("bad", [5, 6, 7], bad)
    admission.hold("gone", [5, 6, 7], good)
    assert admission.abort("gone") and not admission.abort("never held")
    refused = admitted(admission)
    assert [request_id for request_id, _ in refused] == ["bad"] and "regex" in refused[0][1]
    assert engine.has_unfinished()
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    finished = {o.request_id for o in outputs if o.finished}
    assert finished == {"good"}
