"""Engine request handling: stop conditions, abort, and bad requests, on a tiny checkpoint."""

from __future__ import annotations

import shutil

import pytest

from deepinfer_core.engine.engine import RequestError
from deepinfer_core.engine.llm import LLM
from deepinfer_core.engine.tokenizer import demo_tokenizer_dir
from deepinfer_core.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=tiny_checkpoint, accelerator="cpu", block_size=16, progress=False)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, **kw)


def test_max_tokens_ends_with_length(llm):
    [out] = llm.generate([5, 6, 7], greedy(max_tokens=5))
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"


def test_stop_token_ids_end_the_request_and_are_reported(llm):
    [free] = llm.generate([5, 6, 7], greedy(max_tokens=12))
    tokens = free.outputs[0].token_ids
    stop = tokens[3]
    first = tokens.index(stop)
    [out] = llm.generate([5, 6, 7], greedy(max_tokens=12, stop_token_ids=(stop,)))
    assert out.outputs[0].token_ids == tokens[: first + 1]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop)


def test_eos_stops_unless_ignored(llm):
    [free] = llm.generate([5, 6, 7], greedy(max_tokens=12))
    eos = free.outputs[0].token_ids[2]
    llm.engine.eos_token_ids = frozenset({eos})
    try:
        [stopped] = llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=12))
        [ignored] = llm.generate([5, 6, 7], greedy(max_tokens=12))
    finally:
        llm.engine.eos_token_ids = frozenset({1})
    first = free.outputs[0].token_ids.index(eos)
    assert stopped.outputs[0].token_ids == free.outputs[0].token_ids[: first + 1]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason is None
    assert ignored.outputs[0].token_ids == free.outputs[0].token_ids


def test_the_context_limit_ends_with_length(tiny_checkpoint):
    small = LLM(model=tiny_checkpoint, accelerator="cpu", block_size=16, max_model_len=10, progress=False)
    [out] = small.generate([5, 6, 7, 8], greedy(max_tokens=50))
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 10
    assert out.outputs[0].finish_reason == "length"


def test_abort_frees_blocks_and_finishes_the_request(llm):
    engine = llm.engine
    free_before = engine.blocks.num_free_blocks
    engine.add_request("to-abort", list(range(2, 40)), greedy(max_tokens=50))
    engine.add_request("keeps-going", [5, 6, 7], greedy(max_tokens=3))
    engine.step()
    assert engine.blocks.num_free_blocks < free_before
    engine.abort("to-abort")
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert {o.request_id for o in outputs} == {"keeps-going"}
    assert engine.blocks.num_free_blocks == free_before  # everything returned (cached blocks count as free)
    engine.abort("to-abort")  # aborting twice, or an unknown id, is harmless
    engine.abort("never-existed")


def test_bad_requests_are_refused_with_reasons(llm, tiny_checkpoint):
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.generate([5, 6, 100000], greedy(max_tokens=2))
    with pytest.raises(RequestError, match="prompt is empty"):
        llm.generate([[]], greedy(max_tokens=2))
    with pytest.raises(RequestError, match="no tokenizer.json"):
        llm.generate("text needs a tokenizer", greedy(max_tokens=2))
    llm.engine.add_request("dup", [5], greedy(max_tokens=1))
    with pytest.raises(RequestError, match="already in use"):
        llm.engine.add_request("dup", [5], greedy(max_tokens=1))
    llm.engine.abort("dup")
    tiny_cache = LLM(model=tiny_checkpoint, accelerator="cpu", block_size=16, num_kv_blocks=1, progress=False)
    with pytest.raises(RequestError, match=r"may need 30 tokens of KV cache .* but the cache holds 16"):
        tiny_cache.generate([5] * 10, greedy(max_tokens=20))


@pytest.fixture(scope="module")
def text_checkpoint(tmp_path_factory, tiny_checkpoint):
    """The tiny checkpoint with the DeepSeek-V4 tokenizer and a vocabulary to match it."""
    import json

    import torch
    from safetensors.torch import save_file

    from deepinfer_core.model.config import DeepseekConfig
    from deepinfer_core.model.deepseek_v3 import expected_weights

    path = tmp_path_factory.mktemp("tiny-v3-text")
    config = json.loads((tiny_checkpoint / "config.json").read_text()) | {"vocab_size": 129280}
    generator = torch.Generator().manual_seed(1)
    shapes = expected_weights(DeepseekConfig.from_hf(config))
    save_file(
        {n: torch.randn(s, generator=generator) * 0.3 for n, s in shapes.items()}, str(path / "model.safetensors")
    )
    (path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_tokenizer_dir() / name, path / name)
    return path


def test_stop_strings_truncate_the_text(text_checkpoint):
    llm = LLM(model=text_checkpoint, accelerator="cpu", block_size=16, progress=False)
    [free] = llm.generate("Hello there", greedy(max_tokens=16))
    text = free.outputs[0].text
    assert len(text) > 6, text
    stop = text[3:6]
    [out] = llm.generate("Hello there", greedy(max_tokens=16, stop=(stop,)))
    assert out.outputs[0].text == text[: text.index(stop)]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop)
