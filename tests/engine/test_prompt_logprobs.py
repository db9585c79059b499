"""prompt_logprobs (vLLM's shape) and the ranks of logprobs, against transformers on a tiny DeepSeek-V3
and by teacher forcing on the demo DeepSeek-V4: whole and chunked prefill, no prefix-cache hit for the
request that asks for them, one prompt computation for several samples."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.engine.engine import Engine, EngineConfig
from deepinfer_core.engine.llm import LLM
from deepinfer_core.engine.scheduler import SchedulerConfig
from deepinfer_core.sampling.params import SamplingParams

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py

BLOCK, VOCAB, K = 16, 256, 3


@pytest.fixture(scope="module")
def ckpt(hf_checkpoint):
    return hf_checkpoint("b")


@pytest.fixture(scope="module")
def llm(ckpt):
    return _llm(ckpt)


def _llm(ckpt, **kwargs) -> LLM:
    return LLM(model=ckpt.path, accelerator="cpu", block_size=BLOCK, num_kv_blocks=64, progress=False, **kwargs)


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(2, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate(llm: LLM, prompt, params: SamplingParams):
    [out] = llm.generate([prompt], params, use_tqdm=False)
    return out


@torch.no_grad()
def _hf_logprobs(hf_model, token_ids) -> torch.Tensor:
    """logprobs [len - 1, V]: row i is the distribution of token i + 1, from one HF forward."""
    return hf_model(torch.tensor([token_ids])).logits[0, :-1].float().log_softmax(dim=-1)


def _rank(logprobs: torch.Tensor, token: int) -> int:
    """Tokens at least as likely as `token`, itself included (vLLM's rank)."""
    return int((logprobs >= logprobs[token]).sum())


def assert_matches_hf(prompt_logprobs, prompt, hf) -> None:
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        entry, row, token = prompt_logprobs[position], hf[position - 1], prompt[position]
        assert next(iter(entry)) == token  # the prompt token first, then its alternatives
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
        top = row.topk(K)
        assert list(entry) == [token] + [t for t in top.indices.tolist() if t != token]
        for rank, (value, other) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            assert entry[other].rank == rank and entry[other].logprob == pytest.approx(value, abs=1e-4)
        if token not in top.indices.tolist():
            assert entry[token].rank == _rank(row, token) > K


def test_prompt_logprobs_match_transformers_whole_and_chunked(ckpt, llm):
    prompt = _prompt(1, 45)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=K)
    hf = _hf_logprobs(ckpt.hf_model, prompt)
    whole = generate(llm, prompt, params)
    assert_matches_hf(whole.prompt_logprobs, prompt, hf)
    assert generate(llm, prompt, SamplingParams(temperature=0, max_tokens=2)).prompt_logprobs is None

    chunked = _llm(ckpt, max_num_batched_tokens=16)
    steps = []
    schedule = chunked.engine.scheduler.schedule
    chunked.engine.scheduler.schedule = lambda *a: (step := schedule(*a), steps.append(step))[0]
    out = generate(chunked, prompt, params)
    assert [n for step in steps[:3] for _, n in step.requests] == [16, 16, 13]  # three prefill chunks
    assert_matches_hf(out.prompt_logprobs, prompt, hf)
    assert out.outputs[0].token_ids == whole.outputs[0].token_ids


def test_a_request_asking_for_prompt_logprobs_takes_no_prefix_cache_hit(ckpt, llm):
    prompt = _prompt(2, 40)
    hf = _hf_logprobs(ckpt.hf_model, prompt)
    assert generate(llm, prompt, SamplingParams(temperature=0, max_tokens=1)).num_cached_tokens == 0
    assert generate(llm, prompt, SamplingParams(temperature=0, max_tokens=1)).num_cached_tokens == 2 * BLOCK
    asked = generate(llm, prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=K))
    assert asked.num_cached_tokens == 0
    assert_matches_hf(asked.prompt_logprobs, prompt, hf)


def test_several_samples_compute_the_prompt_and_its_logprobs_once(ckpt, llm):
    prompt = _prompt(3, 40)
    hits = llm.engine.blocks.prefix_hits
    params = SamplingParams(temperature=1.0, seed=9, n=3, max_tokens=3, prompt_logprobs=K)
    out = generate(llm, prompt, params)
    assert len(out.outputs) == 3 and len({c.token_ids for c in out.outputs}) > 1
    assert llm.engine.blocks.prefix_hits - hits == 2 * 2 * BLOCK  # samples 1 and 2 read two blocks each
    assert_matches_hf(out.prompt_logprobs, prompt, _hf_logprobs(ckpt.hf_model, prompt))


def test_sampled_tokens_ranks_match_transformers(ckpt, llm):
    prompt = _prompt(4, 12)
    params = SamplingParams(temperature=4.0, seed=11, max_tokens=10, ignore_eos=True, logprobs=1)
    got = generate(llm, prompt, params).outputs[0]
    hf = _hf_logprobs(ckpt.hf_model, prompt + list(got.token_ids))[len(prompt) - 1 :]
    ranks = [entry[token].rank for entry, token in zip(got.logprobs, got.token_ids)]
    assert ranks == [_rank(row, token) for row, token in zip(hf, got.token_ids)]
    assert max(ranks) > 1  # some sampled tokens were outside the top 1


# ---- DeepSeek-V4 (the demo model): teacher forcing ---------------------------------------------


def test_v4_prompt_logprobs_equal_the_logprobs_of_greedy_generation():
    """A prompt extended by its own greedy continuation: the continuation's prompt logprobs are the
    logprobs generation reported (rank 1, the same top alternatives), whole and in chunks of 3."""
    demo = LLM(accelerator="cpu", num_kv_blocks=16, progress=False)
    start = demo.tokenizer.encode("The cat sat")
    generated = generate(demo, start, SamplingParams(temperature=0, max_tokens=5, logprobs=K)).outputs[0]
    prompt = start + list(generated.token_ids)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=K)
    chunked = Engine(
        demo.model,
        demo.backend,
        demo.tokenizer,
        EngineConfig(num_kv_blocks=16, scheduler=SchedulerConfig(max_num_batched_tokens=3)),
    )
    chunked.add_request("chunked", prompt, params)
    finished = []
    while chunked.has_unfinished():
        finished += [o for o in chunked.step() if o.finished]
    for out in (generate(demo, prompt, params), finished[0]):
        logprobs = out.prompt_logprobs
        assert len(logprobs) == len(prompt) and logprobs[0] is None
        assert all(logprobs[p] is not None for p in range(1, len(start)))
        for i, token in enumerate(generated.token_ids):
            entry = logprobs[len(start) + i]
            assert entry[token].rank == 1
            assert entry[token].logprob == pytest.approx(generated.token_logprobs[i], abs=1e-4)
            assert [t for t in entry] == list(generated.top_logprobs[i])
            for other, value in generated.top_logprobs[i].items():
                assert entry[other].logprob == pytest.approx(value, abs=1e-4)
