"""Speculative decoding of DeepSeek-V4 (the embedded demo model) and V4.1 (tiny random checkpoints of both
test schedules: ratio-2 and ratio-4 groups, the ratio-1 decoder, engram look-back): a verify step's rejected
drafts land in the spare window-ring slots and state rows (v4_attention.ROLLBACK_SLOTS), so output stays plain
decoding's token for token even when most drafts are wrong; without the spare rows it does not (the check can
fail); more drafts than spare rows are refused."""

from __future__ import annotations

import pytest

from deepinfer_core.engine.llm import LLM
from deepinfer_core.engine.speculative import SpeculativeError
from deepinfer_core.model import v4_attention, v41_attention, v41_engram
from deepinfer_core.sampling.params import SamplingParams
from tests.model.v41_checkpoints import SCHEDULES, write_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py

PROMPTS = [list(range(30, 35)), list(range(30, 70)), list(range(200, 270))]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=4, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
]
MODELS = ["v4-demo", *(f"v41-{name}" for name in sorted(SCHEDULES))]
SPEC = {"method": "ngram", "num_speculative_tokens": 6}


@pytest.fixture(scope="module")
def v41_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("v41-spec")
    return {f"v41-{name}": write_checkpoint(root / name, s, seed=3) for name, s in SCHEDULES.items()}


class HalfRightDrafts:
    """Drafts that follow the plain run's continuation for 0..3 tokens, then go wrong: most verify steps keep
    a few drafts and reject the rest, the case the spare rows are for."""

    def __init__(self, plain: dict[str, tuple[int, ...]]) -> None:
        self.plain = plain

    def propose_for(self, request, k: int) -> list[int]:
        done = len(request.output_token_ids)
        right = list(self.plain[request.request_id][done : done + k])[: done % 4]
        return (right + [7, 8, 9, 10, 11, 12])[:k]


def _llm(model: str, checkpoints: dict, accelerator: str, speculative=None) -> LLM:
    if model == "v4-demo":
        return LLM(accelerator=accelerator, progress=False, speculative_config=speculative)
    return LLM(model=str(checkpoints[model]), accelerator=accelerator, dtype="float32", block_size=16,
               num_kv_blocks=64, progress=False, speculative_config=speculative)  # fmt: skip


def _generate(llm: LLM, proposer=None) -> dict[str, tuple[int, ...]]:
    if proposer is not None:
        llm.engine.scheduler.proposer = proposer
    return {o.request_id: o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)}


@pytest.mark.parametrize("accelerator", ["cpu", "rowwise_cpu"])
@pytest.mark.parametrize("model", MODELS)
def test_output_is_the_plain_output_through_rejections(v41_checkpoints, model, accelerator):
    want = _generate(_llm(model, v41_checkpoints, accelerator))
    spec = _llm(model, v41_checkpoints, accelerator, SPEC)
    got = _generate(spec, HalfRightDrafts(want))
    assert got == want
    stats = spec.engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens / 2  # mostly rejected, some kept


@pytest.mark.parametrize("model", MODELS)
def test_without_spare_rows_the_output_changes(v41_checkpoints, model, monkeypatch):
    want = _generate(_llm(model, v41_checkpoints, "cpu"))
    for module in (v4_attention, v41_attention, v41_engram):  # rings and states sized without spare rows
        monkeypatch.setattr(module, "ROLLBACK_SLOTS", 0)
    got = _generate(_llm(model, v41_checkpoints, "cpu", SPEC), HalfRightDrafts(want))
    assert got != want


@pytest.mark.parametrize("model", MODELS)
def test_more_drafts_than_the_spare_rows_are_refused(v41_checkpoints, model):
    with pytest.raises(SpeculativeError, match="at most 6 drafted tokens"):
        _llm(model, v41_checkpoints, "cpu", {"method": "ngram", "num_speculative_tokens": 7})
