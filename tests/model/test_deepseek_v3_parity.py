"""Our DeepSeek-V3 against Hugging Face transformers' (issue 3): float32 logits at every position of a
ragged batch run in one forward over a paged cache with a shuffled block table."""

from __future__ import annotations

import copy

import pytest
import torch

from deepinfer_core.backend.registry import discover
from deepinfer_core.backend.resolve import resolve_backend
from deepinfer_core.backend.selection import select_backend
from deepinfer_core.engine.request import Request
from deepinfer_core.engine.runner import ModelRunner
from deepinfer_core.model import load_model, model_registry
from deepinfer_core.model.config import DeepseekConfig
from deepinfer_core.model.deepseek_v3 import FLOAT32_WEIGHTS, DeepseekV3Model, expected_weights
from deepinfer_core.model.loader import load_tensors, read_config
from deepinfer_core.sampling.params import SamplingParams

BLOCK = 16
NUM_BLOCKS = 32
LENGTHS = [1, 7, 40, 100]  # one token, under a block, non-multiples spanning 3 and 7 blocks
VARIANTS = ["a", "b"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py


@pytest.fixture(scope="module")
def backend():
    return resolve_backend(select_backend(discover(), "cpu"), dtype=torch.float32, block_size=BLOCK)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in LENGTHS]


def _our_model(path, backend, zero_bias: bool = False) -> DeepseekV3Model:
    if not zero_bias:
        return load_model(path, backend, model_registry(), progress=False)
    raw = read_config(path)
    config = DeepseekConfig.from_hf(raw)
    weights = load_tensors(path, raw, expected_weights(config), backend.dtype, FLOAT32_WEIGHTS, progress=False)
    biases = [n for n in weights if n.endswith("e_score_correction_bias")]
    assert len(biases) == 2 and all(weights[n].abs().min() > 0 for n in biases)
    for name in biases:
        weights[name] = torch.zeros_like(weights[name])
    return DeepseekV3Model(config, weights, backend)


def _requests(prompts, seed: int = 0) -> list[Request]:
    """Requests holding blocks in shuffled order, drawn from the whole pool (not contiguous, not sorted)."""
    free = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
    requests = []
    for i, prompt in enumerate(prompts):
        request = Request(str(i), None, list(prompt), SamplingParams(), seed=0, arrival=i)
        request.block_ids = [free.pop() for _ in range(-(-len(prompt) // BLOCK))]
        requests.append(request)
    tables = [r.block_ids for r in requests]
    assert any(t != sorted(t) or t != list(range(t[0], t[0] + len(t))) for t in tables)
    return requests


def _runner(model, backend) -> ModelRunner:
    runner = ModelRunner(model, backend, NUM_BLOCKS)
    g = torch.Generator().manual_seed(99)
    for cache in (c for layer in runner.caches for c in layer.values()):  # garbage in every slot: reading one
        cache.copy_(50 * torch.randn(cache.shape, generator=g))
    return runner


@torch.inference_mode()
def _step_logits(model, runner, scheduled) -> list[torch.Tensor]:
    """One ragged forward of `scheduled` [(request, tokens)]; per request, logits [tokens, V] of its rows."""
    batch = runner.prepare(scheduled)
    assert batch.meta.num_seqs == len(scheduled)
    logits = model.logits(model.forward(batch.token_ids, batch.positions, batch.meta, runner.caches))
    starts = batch.meta.query_start_loc.tolist()
    for request, count in scheduled:
        request.num_computed_tokens += count
    return [logits[starts[i] : starts[i + 1]] for i in range(len(scheduled))]


@torch.no_grad()
def _hf_logits(hf_model, prompts) -> list[torch.Tensor]:
    return [hf_model(torch.tensor([p])).logits[0].float() for p in prompts]


def _our_ragged_logits(model, backend, prompts) -> list[torch.Tensor]:
    requests = _requests(prompts)
    return _step_logits(model, _runner(model, backend), [(r, r.num_tokens) for r in requests])


@pytest.mark.parametrize("variant", VARIANTS)
def test_ragged_prefill_logits_match_hf(hf_checkpoint, backend, prompts, variant):
    ckpt = hf_checkpoint(variant)
    model = _our_model(ckpt.path, backend)
    ours = _our_ragged_logits(model, backend, prompts)
    for prompt, mine, theirs in zip(prompts, ours, _hf_logits(ckpt.hf_model, prompts)):
        n = len(prompt)
        assert mine.shape == theirs.shape == (n, 256)
        assert mine.dtype == theirs.dtype == torch.float32
        torch.testing.assert_close(mine, theirs, msg=lambda m, n=n: f"prompt of {n} tokens: {m}")
        assert theirs.std() > 1.0  # logits are far from flat: the comparison has teeth


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_steps_over_the_cache_match_hf(hf_checkpoint, backend, prompts, variant):
    """Two ragged steps: first chunks of three prompts, then the rest of all four (the 7-token prompt
    as a 1-token step, the 1-token prompt starting fresh) reading the first step's latents back from
    the paged cache. Logits of both steps, stitched per prompt, match HF's at every position."""
    ckpt = hf_checkpoint(variant)
    model = _our_model(ckpt.path, backend)
    runner = _runner(model, backend)
    requests = _requests(prompts, seed=1)
    first = {1: 6, 2: 17, 3: 64}  # prompt index -> tokens in step 1 (17: one past a block boundary)
    step1 = _step_logits(model, runner, [(requests[i], n) for i, n in first.items()])
    step2 = _step_logits(model, runner, [(r, r.num_tokens - r.num_computed_tokens) for r in requests])
    assert [r.num_computed_tokens for r in requests] == LENGTHS
    hf = _hf_logits(ckpt.hf_model, prompts)
    for i, (prompt, theirs) in enumerate(zip(prompts, hf)):
        mine = torch.cat([step1[list(first).index(i)], step2[i]]) if i in first else step2[i]
        n = len(prompt)
        torch.testing.assert_close(mine, theirs, msg=lambda m, n=n: f"prompt of {n} tokens: {m}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_correction_bias_matters(hf_checkpoint, backend, prompts, variant):
    """The parity check can fail: without the score-correction bias our logits leave HF's, and they
    return to HF's exactly when HF's bias is zeroed too (so the bias is the only difference)."""
    ckpt = hf_checkpoint(variant)
    no_bias = _our_ragged_logits(_our_model(ckpt.path, backend, zero_bias=True), backend, prompts)
    hf = _hf_logits(ckpt.hf_model, prompts)
    for mine, theirs in zip(no_bias[1:], hf[1:]):  # prompts of 7+ tokens: some token is routed differently
        assert not torch.allclose(mine, theirs, rtol=1.3e-6, atol=1e-5)
        assert (mine - theirs).abs().max() > 1e-2
    hf_no_bias = copy.deepcopy(ckpt.hf_model)
    for name, buffer in hf_no_bias.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.zero_()
    for mine, theirs in zip(no_bias, _hf_logits(hf_no_bias, prompts)):
        torch.testing.assert_close(mine, theirs)


def test_variants_differ(hf_checkpoint, backend, prompts):
    """Another model's logits are far outside the tolerance: the comparison is not vacuous."""
    ours_b = _our_ragged_logits(_our_model(hf_checkpoint("b").path, backend), backend, prompts)
    for mine, theirs in zip(ours_b, _hf_logits(hf_checkpoint("a").hf_model, prompts)):
        assert (mine - theirs).abs().max() > 1.0
