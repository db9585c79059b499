"""General plugins (`deepinfer.plugins`) reach the engine: logits processors and observers."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.engine.llm import LLM
from deepinfer_core.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def favour_token_zero(llm: LLM) -> None:
    """Make the model's logits prefer token 0 at every step."""
    vocab = llm.model.config.vocab_size
    llm.model.logits = lambda hidden: torch.zeros(hidden.shape[0], vocab).index_fill_(1, torch.tensor([0]), 10.0)


@pytest.fixture
def plugin_site(install_distributions, monkeypatch):
    monkeypatch.syspath_prepend(str(install_distributions("test_plugins")))


def test_without_the_plugin_token_zero_wins(tiny_checkpoint):
    llm = LLM(model=tiny_checkpoint, accelerator="cpu", block_size=16, progress=False)
    favour_token_zero(llm)
    assert llm.generate([5, 6, 7], GREEDY)[0].outputs[0].token_ids == (0, 0, 0, 0)


def test_a_plugins_logits_processor_bans_token_zero(plugin_site, tiny_checkpoint):
    llm = LLM(model=tiny_checkpoint, accelerator="cpu", block_size=16, progress=False)
    favour_token_zero(llm)
    [output] = llm.generate([5, 6, 7], GREEDY)
    assert len(output.outputs[0].token_ids) == 4 and 0 not in output.outputs[0].token_ids


def test_a_plugins_observer_sees_finished_requests(plugin_site, tiny_checkpoint):
    llm = LLM(model=tiny_checkpoint, accelerator="cpu", block_size=16, progress=False)
    [counter] = llm.engine.observers
    llm.generate([[5, 6, 7], [8, 9]], GREEDY)
    assert counter.finished == 2
