"""Under `auto`, a model goes to the first available backend able to run it (DeepSeek-V4 on a machine
whose preferred backend lacks the V4 ops); a backend asked for by name is never swapped."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from deepinfer_core.engine.llm import _load_on_first_able
from deepinfer_core.model.deepseek_v4 import UnsupportedModelError


@dataclass
class Entry:
    name: str
    available: bool = True
    reason: str = ""


@dataclass
class Discovery:
    backends: list
    broken: tuple = ()


def _load(on: str) -> str:
    if on in ("gpu", "npu"):
        raise UnsupportedModelError(f"backend {on} cannot run DeepSeek-V4: it lacks sparse_attention (no kernel)")
    return f"model on {on}"


def test_auto_falls_back_to_the_next_backend_that_can_run_the_model(caplog, monkeypatch):
    monkeypatch.delenv("DEEPINFER_ACCELERATOR", raising=False)
    discovery = Discovery([Entry("gpu"), Entry("npu", available=False), Entry("cpu")])
    backend, model = _load_on_first_able(discovery, None, lambda entry: entry.name, _load)
    assert (backend, model) == ("cpu", "model on cpu")
    assert "backend gpu cannot run DeepSeek-V4" in caplog.text and "trying the next available backend" in caplog.text


def test_the_last_refusal_is_raised_when_no_backend_can(monkeypatch):
    monkeypatch.delenv("DEEPINFER_ACCELERATOR", raising=False)
    with pytest.raises(UnsupportedModelError, match="backend gpu cannot run"):
        _load_on_first_able(Discovery([Entry("gpu")]), "auto", lambda entry: entry.name, _load)


def test_a_named_backend_is_not_swapped(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "gpu")
    discovery = Discovery([Entry("gpu"), Entry("cpu")])
    with pytest.raises(UnsupportedModelError, match="backend gpu cannot run"):
        _load_on_first_able(discovery, None, lambda entry: entry.name, _load)
