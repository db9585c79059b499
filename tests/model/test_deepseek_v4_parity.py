"""Our DeepSeek-V4 against Hugging Face transformers' `DeepseekV4ForCausalLM` (issue 8): float32 logits
at every position of a ragged batch in one forward, and over several chunked steps that read the
sliding windows, compressor state and compressed entries back from the caches."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.backend.registry import discover
from deepinfer_core.backend.resolve import resolve_backend
from deepinfer_core.backend.selection import select_backend
from deepinfer_core.model import load_model, model_registry
from deepinfer_core.model.config_v4 import DeepseekV4Config
from deepinfer_core.model.deepseek_v4 import DeepseekV4Model
from tests.model.step_runner import garbage_runner, shuffled_requests, step_logits

BLOCK = 16
NUM_BLOCKS = 40
SEQ_SLOTS = 8
LENGTHS = [1, 7, 40, 100]  # one token, under a window, several compressed blocks
VARIANTS = ["a", "b"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py


@pytest.fixture(scope="module")
def backend():
    return resolve_backend(select_backend(discover(), "cpu"), dtype=torch.float32, block_size=BLOCK)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in LENGTHS]


def _model(ckpt, backend) -> DeepseekV4Model:
    model = load_model(ckpt.path, backend, model_registry(), progress=False)
    assert isinstance(model, DeepseekV4Model)
    return model


def _requests(prompts, seed: int):
    return shuffled_requests(prompts, seed, num_blocks=NUM_BLOCKS, seq_slots=SEQ_SLOTS, block=BLOCK)


def _runner(model, backend):
    return garbage_runner(model, backend, num_blocks=NUM_BLOCKS, seq_slots=SEQ_SLOTS)


_step_logits = step_logits


@torch.no_grad()
def _hf_logits(hf_model, prompts) -> list[torch.Tensor]:
    return [hf_model(torch.tensor([p])).logits[0].float() for p in prompts]


@pytest.mark.parametrize("variant", VARIANTS)
def test_ragged_prefill_logits_match_hf(hf_v4_checkpoint, backend, prompts, variant):
    ckpt = hf_v4_checkpoint(variant)
    model = _model(ckpt, backend)
    requests = _requests(prompts, seed=0)
    ours = _step_logits(model, _runner(model, backend), [(r, r.num_tokens) for r in requests])
    for prompt, mine, theirs in zip(prompts, ours, _hf_logits(ckpt.hf_model, prompts)):
        n = len(prompt)
        assert mine.shape == theirs.shape == (n, 256)
        torch.testing.assert_close(mine, theirs, msg=lambda m, n=n: f"prompt of {n} tokens: {m}")
        assert theirs.std() > 0.5  # far from flat: the comparison has teeth


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_and_single_token_steps_match_hf(hf_v4_checkpoint, backend, prompts, variant):
    """Three ragged steps with chunks that end inside windows, on window boundaries and one token at a
    time: every later step reads the earlier ones' ring entries, compressor state and compressed
    entries back from the caches. Logits of all steps, stitched per prompt, match HF's."""
    ckpt = hf_v4_checkpoint(variant)
    model = _model(ckpt, backend)
    runner = _runner(model, backend)
    requests = _requests(prompts, seed=1)
    plan = [{1: 3, 2: 13, 3: 37}, {1: 1, 2: 1, 3: 50}, {0: 1, 1: 3, 2: 26, 3: 13}]
    stitched: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(prompts))}
    for step in plan:
        for i, logits in zip(step, _step_logits(model, runner, [(requests[i], n) for i, n in step.items()])):
            stitched[i].append(logits)
    assert [r.num_computed_tokens for r in requests] == LENGTHS
    for i, theirs in enumerate(_hf_logits(ckpt.hf_model, prompts)):
        n = len(prompts[i])
        torch.testing.assert_close(torch.cat(stitched[i]), theirs, msg=lambda m, n=n: f"prompt of {n} tokens: {m}")


def test_variants_differ(hf_v4_checkpoint, backend, prompts):
    """Another model's logits are far outside the tolerance: the comparison is not vacuous."""
    model = _model(hf_v4_checkpoint("b"), backend)
    requests = _requests(prompts, seed=0)
    ours = _step_logits(model, _runner(model, backend), [(r, r.num_tokens) for r in requests])
    for mine, theirs in zip(ours[1:], _hf_logits(hf_v4_checkpoint("a").hf_model, prompts)[1:]):
        assert (mine - theirs).abs().max() > 0.5


def test_config_reads_as_transformers_does(hf_v4_checkpoint):
    """Legacy spellings (compress_ratios, num_hash_layers, qk_rope_head_dim, flat rope_scaling) give
    the fields transformers derives from them."""
    from transformers import DeepseekV4Config as HFConfig

    legacy = dict(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=5,
        num_attention_heads=4,
        head_dim=32,
        q_lora_rank=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        compress_ratios=[128, 4, 0, 4, 128],
        num_hash_layers=2,
        qk_rope_head_dim=8,
        rope_scaling={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536},
        compress_rope_theta=40000.0,
    )
    hf = HFConfig(**legacy)
    ours = DeepseekV4Config.from_hf({"architectures": ["DeepseekV4ForCausalLM"], **legacy})
    assert list(ours.layer_types) == hf.layer_types
    assert list(ours.mlp_layer_types) == hf.mlp_layer_types
    assert ours.qk_rope_head_dim == hf.qk_rope_head_dim == 8
    compress = hf.rope_parameters["compress"]
    assert ours.rope_compress.kind == compress["rope_type"] == "yarn"
    assert ours.rope_compress.theta == compress["rope_theta"] == 40000.0
    assert ours.rope_compress.factor == compress["factor"]
    assert ours.rope_compress.attention_factor == compress["attention_factor"] == 1.0
    assert ours.rope_main.kind == "default" and ours.rope_main.theta == hf.rope_parameters["main"]["rope_theta"]
    # the defaults transformers fills in (V4 Flash's)
    assert ours.compress_rates == hf.compress_rates
    assert (ours.sliding_window, ours.hc_mult, ours.index_topk) == (hf.sliding_window, hf.hc_mult, hf.index_topk)
