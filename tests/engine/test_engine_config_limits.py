"""Engine limits (issue #14): a model whose layers are all sliding-window starts and serves; max_model_len
past the model's context and counts or sizes below 1 are refused at construction, naming the flag, before
the weights load."""

from __future__ import annotations

import pytest
import torch

import deepinfer_core.engine.llm as llm_module
from deepinfer_core.engine.engine import Engine, EngineConfig
from deepinfer_core.engine.llm import LLM
from deepinfer_core.engine.scheduler import SchedulerConfig
from deepinfer_core.errors import DeepInferError
from deepinfer_core.kv.caches import block_bytes
from deepinfer_core.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py


def _prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 128, (n,), generator=g).tolist() for n in lengths]  # in both tiny vocabularies


def _hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


# ---- a model with no paged cache ---------------------------------------------------------------


def test_an_all_sliding_window_model_starts_and_matches_hf(hf_v4_checkpoint):
    """Sized from the memory budget (the path that divided by a zero block size): its blocks cost nothing,
    so every sequence slot can reach max_model_len; a prefix hit rebuilds the windows by replay."""
    ckpt = hf_v4_checkpoint("sliding")
    llm = LLM(model=ckpt.path, accelerator="cpu", block_size=16, max_num_seqs=4, progress=False)
    blocks = llm.engine.blocks
    assert block_bytes(llm.model.cache_specs, blocks.block_size) == 0
    assert blocks.num_blocks == 4 * llm.engine.max_model_len // blocks.block_size
    first, second = _prompts(3, [40, 7])
    shared = first[:32] + second  # two full blocks in common with `first`
    for prompt in (first, shared):  # one after the other, so the second finds the first's blocks cached
        [out] = llm.generate([prompt], GREEDY, use_tqdm=False)
        assert list(out.outputs[0].token_ids) == _hf_greedy(ckpt.hf_model, prompt, GREEDY.max_tokens)
    assert blocks.prefix_hits == 32


def test_an_all_sliding_window_budget_below_the_windows_is_refused(hf_v4_checkpoint):
    path = hf_v4_checkpoint("sliding").path
    with pytest.raises(DeepInferError, match="does not fit the per-sequence caches of 4 sequences"):
        LLM(model=path, accelerator="cpu", max_num_seqs=4, kv_cache_memory_bytes=1024, progress=False)


# ---- max_model_len against the model's context ----------------------------------------------------


def test_max_model_len_up_to_the_models_context_is_taken(tiny_checkpoint):
    llm = LLM(model=tiny_checkpoint, accelerator="cpu", max_model_len=256, progress=False)  # its context: 256
    assert llm.engine.max_model_len == 256
    assert LLM(model=tiny_checkpoint, accelerator="cpu", progress=False).engine.max_model_len == 256


def test_max_model_len_past_the_models_context_is_refused(tiny_checkpoint):
    message = r"max_model_len \(--max-model-len\) 257 is longer than the model's context of 256 tokens.*lower"
    with pytest.raises(DeepInferError, match=message):
        LLM(model=tiny_checkpoint, accelerator="cpu", max_model_len=257, progress=False)
    built = LLM(model=tiny_checkpoint, accelerator="cpu", progress=False)  # the engine refuses it too
    with pytest.raises(DeepInferError, match=message):
        Engine(built.model, built.backend, None, EngineConfig(max_model_len=257))


# ---- counts and sizes below 1 ---------------------------------------------------------------------


@pytest.fixture
def no_loading(monkeypatch):
    """The demo model's loader fails the test: a refusal must come before the weights are built."""

    def load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the settings were checked")

    monkeypatch.setattr(llm_module, "demo_model", load)


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("max_num_seqs", 0, r"max_num_seqs \(--max-num-seqs\) must be at least 1, got 0"),
        ("max_num_seqs", -3, r"max_num_seqs \(--max-num-seqs\) must be at least 1, got -3"),
        ("max_num_batched_tokens", 0, r"max_num_batched_tokens \(--max-num-batched-tokens\) must be at least 1"),
        ("max_model_len", 0, r"max_model_len \(--max-model-len\) must be at least 1, got 0"),
        ("max_model_len", 8193, r"max_model_len \(--max-model-len\) 8193 is longer than the model's context of 8192"),
        ("block_size", 0, r"block_size \(--block-size\) must be at least 1, got 0"),
        ("num_kv_blocks", 0, r"num_kv_blocks \(--num-kv-blocks\) must be at least 1, got 0"),
        ("kv_cache_memory_bytes", 0, r"kv_cache_memory_bytes \(--kv-cache-memory-bytes\) must be at least 1"),
        ("kv_cache_memory_bytes", -1, r"kv_cache_memory_bytes \(--kv-cache-memory-bytes\) must be at least 1"),
        ("gpu_memory_utilization", 0.0, r"gpu_memory_utilization must be in \(0, 1\] \(--gpu-memory-utilization"),
        ("gpu_memory_utilization", -0.5, r"gpu_memory_utilization must be in \(0, 1\]"),
        ("gpu_memory_utilization", 1.01, r"gpu_memory_utilization must be in \(0, 1\]"),
    ],
)
def test_a_bad_limit_is_refused_before_loading(no_loading, setting, value, message):
    with pytest.raises(DeepInferError, match=message):
        LLM(accelerator="cpu", progress=False, **{setting: value})  # the demo model: its context is 8192


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: SchedulerConfig(max_num_seqs=0), r"max_num_seqs \(--max-num-seqs\) must be at least 1"),
        (lambda: SchedulerConfig(max_num_batched_tokens=0), r"max_num_batched_tokens \(--max-num-batched-tokens\)"),
        (lambda: EngineConfig(max_model_len=-1), r"max_model_len \(--max-model-len\) must be at least 1, got -1"),
        (lambda: EngineConfig(num_kv_blocks=0), r"num_kv_blocks \(--num-kv-blocks\) must be at least 1"),
        (lambda: EngineConfig(kv_cache_memory_bytes=0), r"kv_cache_memory_bytes \(--kv-cache-memory-bytes\)"),
    ],
)
def test_the_engine_configs_refuse_a_bad_limit(make, message):
    with pytest.raises(DeepInferError, match=message):
        make()


def test_a_one_token_step_budget_still_makes_progress(tiny_checkpoint):
    """max_num_batched_tokens 1 is slow but valid: prefills are chunked down to one token a step."""
    prompts = _prompts(4, [9, 5])
    want = LLM(model=tiny_checkpoint, accelerator="cpu", progress=False).generate(prompts, GREEDY, use_tqdm=False)
    one = LLM(model=tiny_checkpoint, accelerator="cpu", max_num_batched_tokens=1, progress=False)
    got = one.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
