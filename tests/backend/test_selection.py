"""Selection errors name where the requested backend came from: the flag or argument, the environment
variable, or the default."""

from __future__ import annotations

import pytest

from deepinfer_core.backend.registry import discover
from deepinfer_core.backend.selection import accelerator_source, select_backend
from deepinfer_core.errors import BackendSelectionError


@pytest.fixture(scope="module")
def discovery():
    return discover()


def message(discovery, *args, **kwargs) -> str:
    with pytest.raises(BackendSelectionError) as err:
        select_backend(discovery, *args, **kwargs)
    return str(err.value)


def test_the_source_of_an_explicit_value_is_the_flag(discovery, monkeypatch):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "cpu")  # set, but not where the value came from
    text = message(discovery, "nosuch", source="--backend")
    assert (
        "unknown backend 'nosuch' (from --backend)" in text and "Pass one of these names or `auto` to --backend" in text
    )
    assert "DEEPINFER_ACCELERATOR" not in text
    assert "unknown backend 'nosuch' (from --accelerator)" in message(discovery, "nosuch")  # the default flag name


def test_the_source_of_no_explicit_value_is_the_variable(discovery, monkeypatch):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "tpu")
    text = message(discovery, None, source="--backend")
    assert "unknown backend 'tpu' (from $DEEPINFER_ACCELERATOR=tpu)" in text
    assert "Set DEEPINFER_ACCELERATOR to one of these names or `auto`, or unset it" in text and "--backend" not in text
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "ascend")
    assert "It was asked for by $DEEPINFER_ACCELERATOR=ascend." in message(discovery)


def test_accelerator_source(monkeypatch):
    monkeypatch.delenv("DEEPINFER_ACCELERATOR", raising=False)
    assert accelerator_source(None) == "the default"
    assert accelerator_source("cpu", "--backend") == "--backend"
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", " nvidia ")
    assert accelerator_source(None) == "$DEEPINFER_ACCELERATOR=nvidia"
    assert accelerator_source("", "--backend") == "--backend"  # given, even if empty (it means auto)
