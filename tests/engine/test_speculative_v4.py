"""Speculative decoding of DeepSeek-V4 (the embedded demo model): rejected drafts are rolled back out of the
compressor and indexer states (model/state_rollback.py), so output stays plain decoding's token for token even
when most drafts are wrong; without the rollback it does not (the check can fail); too many drafts for the
window rings' spare slots are refused."""

from __future__ import annotations

import pytest

from deepinfer_core.engine.llm import LLM
from deepinfer_core.engine.speculative import SpeculativeError
from deepinfer_core.sampling.params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py

PROMPTS = [list(range(30, 35)), list(range(30, 70)), list(range(200, 270))]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=4, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
]


class HalfRightDrafts:
    """Drafts that follow the plain run's continuation for 0..3 tokens, then go wrong: most verify steps keep
    a few drafts and reject the rest, the case the rollback is for."""

    def __init__(self, plain: dict[str, tuple[int, ...]]) -> None:
        self.plain = plain

    def propose_for(self, request, k: int) -> list[int]:
        done = len(request.output_token_ids)
        right = list(self.plain[request.request_id][done : done + k])[: done % 4]
        return (right + [7, 8, 9, 10, 11, 12])[:k]


def _generate(accelerator: str, speculative=None, proposer=None):
    llm = LLM(accelerator=accelerator, progress=False, speculative_config=speculative)
    if proposer is not None:
        llm.engine.scheduler.proposer = proposer
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)  # request ids "0", "1", "2"
    return llm, {o.request_id: o.outputs[0].token_ids for o in outputs}


@pytest.mark.parametrize("accelerator", ["cpu", "rowwise_cpu"])
def test_v4_output_is_the_plain_output_through_rejections(accelerator):
    _, want = _generate(accelerator)
    spec, got = _generate(accelerator, {"method": "ngram", "num_speculative_tokens": 6}, HalfRightDrafts(want))
    assert got == want
    stats = spec.engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens / 2  # mostly rejected, some kept


def test_without_the_rollback_the_output_changes(monkeypatch):
    _, want = _generate("rowwise_cpu")
    llm = LLM(accelerator="rowwise_cpu", progress=False, speculative_config={"method": "ngram",
              "num_speculative_tokens": 6})  # fmt: skip
    monkeypatch.setattr(llm.engine.model.speculative_rollback, "restore", lambda *args: None)
    llm.engine.scheduler.proposer = HalfRightDrafts(want)
    got = {o.request_id: o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)}
    assert got != want


def test_more_drafts_than_the_rings_spare_slots_are_refused():
    with pytest.raises(SpeculativeError, match="at most 6 drafted tokens"):
        LLM(accelerator="cpu", progress=False, speculative_config={"method": "ngram", "num_speculative_tokens": 7})
