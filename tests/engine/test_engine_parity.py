"""The engine end to end against Hugging Face transformers (issue 3), on the reference `cpu` backend:
greedy generation, chunked prefill, prefix-cache hits, preemption, seeded sampling, bad input."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.engine.engine import RequestError
from deepinfer_core.engine.llm import LLM
from deepinfer_core.errors import DeepInferError
from deepinfer_core.sampling.params import SamplingParams

pytest.importorskip("transformers")

BLOCK = 16
VOCAB = 256


@pytest.fixture(scope="module")
def ckpt_a(hf_checkpoint):
    return hf_checkpoint("a")


@pytest.fixture(scope="module")
def ckpt_b(hf_checkpoint):
    return hf_checkpoint("b")


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py


def _llm(ckpt, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 64)
    return LLM(model=ckpt.path, accelerator="cpu", block_size=BLOCK, progress=False, **kwargs)


def _prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _record_steps(llm: LLM) -> list:
    """Every ScheduledStep the engine's scheduler hands out from now on."""
    steps = []
    schedule = llm.engine.scheduler.schedule

    def recording(*args):
        step = schedule(*args)
        steps.append(step)
        return step

    llm.engine.scheduler.schedule = recording
    return steps


def _assert_same_logprobs(got, want) -> None:
    """Same tokens, same chosen-token logprobs, same top-k ids (in order) and values."""
    assert got.token_ids == want.token_ids
    torch.testing.assert_close(torch.tensor(got.token_logprobs), torch.tensor(want.token_logprobs))
    assert len(got.top_logprobs) == len(want.top_logprobs)
    for mine, theirs in zip(got.top_logprobs, want.top_logprobs):
        assert list(mine) == list(theirs)
        torch.testing.assert_close(torch.tensor(list(mine.values())), torch.tensor(list(theirs.values())))


@torch.no_grad()
def _hf_top_logprobs(hf_model, prompt, generated, k):
    """HF's top-k (ids, logprobs) for each generated token, from one full forward of prompt + generated."""
    logits = hf_model(torch.tensor([list(prompt) + list(generated)])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logprobs.topk(k, dim=-1)


# ---- greedy ------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["a", "b"])
def test_greedy_batch_matches_hf_generate(request, variant):
    ckpt = request.getfixturevalue(f"ckpt_{variant}")
    new = 40
    prompts = _prompts(11, [5, 23, 48, 70])
    hf = []
    for prompt in prompts:
        with torch.no_grad():
            ids = ckpt.hf_model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=new, eos_token_id=None, pad_token_id=0
            )
        hf.append(ids[0, len(prompt) :].tolist())
        assert len(hf[-1]) == new  # HF did not stop early either
        assert len(set(hf[-1])) > 3  # not a degenerate constant continuation
    llm = _llm(ckpt)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    for prompt, out, want in zip(prompts, outs, hf):
        assert list(out.outputs[0].token_ids) == want, f"prompt of {len(prompt)} tokens"
        assert out.outputs[0].finish_reason == "length"
    # without ignore_eos the same batch stops right after the model's eos (id 1), where HF's has one
    stopped = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new))
    for out, want in zip(stopped, hf):
        cut = want.index(1) + 1 if 1 in want else new
        assert list(out.outputs[0].token_ids) == want[:cut]
        assert out.outputs[0].finish_reason == ("stop" if cut < new else "length")
    if variant == "b":  # these prompts do reach eos greedily on variant b: ignore_eos was put to the test
        assert any(1 in want for want in hf)


# ---- chunked prefill ---------------------------------------------------------------------------


def test_chunked_prefill_matches_unchunked_and_hf(ckpt_b):
    """A 100-token prompt prefilled 16 tokens a step at most, next to a short request that decodes
    meanwhile, gives the tokens and top-5 logprobs of the run that prefilled it in one step."""
    prompts = _prompts(21, [9, 100])
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=5, ignore_eos=True)
    whole = _llm(ckpt_b, max_num_batched_tokens=2048)
    whole_steps = _record_steps(whole)
    want = whole.generate(prompts, params)
    chunked = _llm(ckpt_b, max_num_batched_tokens=16)
    steps = _record_steps(chunked)
    got = chunked.generate(prompts, params)

    assert [n for _, n in whole_steps[0].requests] == [9, 100]  # the reference prefilled in one go
    assert all(step.num_tokens <= 16 for step in steps)
    long_id = got[1].request_id
    chunks = [n for step in steps for r, n in step.requests if r.request_id == long_id]
    prefill = chunks[: len(chunks) - 9]  # the last 9 are decodes (the first token comes with the prefill)
    assert sum(prefill) == 100 and len(prefill) >= 7 and max(prefill) <= 16, chunks
    assert chunks[len(prefill) :] == [1] * 9
    assert any(  # some step prefilled a chunk of the long prompt while the short one decoded
        len(s.requests) == 2 and s.requests[0][1] == 1 and s.requests[1][1] > 1 for s in steps
    )
    for g, w in zip(got, want):
        _assert_same_logprobs(g.outputs[0], w.outputs[0])
    # and both are HF's: top-5 of every generated position, from one full HF forward
    for prompt, out in zip(prompts, got):
        values, ids = _hf_top_logprobs(ckpt_b.hf_model, prompt, out.outputs[0].token_ids, 5)
        for mine, hf_ids, hf_values in zip(out.outputs[0].top_logprobs, ids.tolist(), values):
            assert list(mine) == hf_ids
            torch.testing.assert_close(torch.tensor(list(mine.values())), hf_values)


# ---- prefix caching ----------------------------------------------------------------------------


def test_prefix_cache_hit_matches_uncached_run(ckpt_b):
    [prefix, tail_a, tail_b] = _prompts(31, [56, 10, 15])  # 3 full blocks + 8 tokens shared
    first, second = prefix + tail_a, prefix + tail_b
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=5, ignore_eos=True)
    cached = _llm(ckpt_b, enable_prefix_caching=True)
    [out_a] = cached.generate([first], params)
    [out_b] = cached.generate([second], params)
    assert out_a.num_cached_tokens == 0
    assert out_b.num_cached_tokens == 3 * BLOCK  # the fourth block holds tokens of both tails: a miss
    assert cached.engine.blocks.prefix_hits == 3 * BLOCK

    fresh = _llm(ckpt_b, enable_prefix_caching=False)
    [want] = fresh.generate([second], params)
    assert want.num_cached_tokens == 0
    _assert_same_logprobs(out_b.outputs[0], want.outputs[0])
    [want_a] = fresh.generate([first], params)  # the uncached engine does not reuse anything either
    assert want_a.num_cached_tokens == 0
    _assert_same_logprobs(out_a.outputs[0], want_a.outputs[0])

    # a block's identity is its whole prefix: a prompt that starts with the prefix's second block
    # finds nothing, although the cache holds a block with exactly those 16 tokens
    third = prefix[BLOCK : 2 * BLOCK] + tail_b
    [out_c] = cached.generate([third], params)
    assert out_c.num_cached_tokens == 0
    _assert_same_logprobs(out_c.outputs[0], fresh.generate([third], params)[0].outputs[0])


# ---- preemption --------------------------------------------------------------------------------


PREEMPT_LENGTHS = [20, 33, 47, 60, 28, 52]


def _mixed_params(max_tokens: int) -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [
        greedy
        if i % 2 == 0
        else SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=max_tokens, ignore_eos=True)
        for i in range(len(PREEMPT_LENGTHS))
    ]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_completes_every_request_with_the_same_tokens(ckpt_b, prefix_caching):
    prompts = _prompts(41, PREEMPT_LENGTHS)
    params = _mixed_params(24)
    want = _llm(ckpt_b, num_kv_blocks=64, enable_prefix_caching=prefix_caching).generate(prompts, params)

    # 7 blocks of 16: enough for the longest request (60 + 24 tokens = 6 blocks), not for two at once
    tight = _llm(ckpt_b, num_kv_blocks=7, enable_prefix_caching=prefix_caching)
    steps = _record_steps(tight)
    scheduler = tight.engine.scheduler
    requests, preempted = [], []  # every request; (request id, tokens generated) at each preemption
    add, preempt = scheduler.add, scheduler._preempt
    scheduler.add = lambda r: (requests.append(r), add(r))[1]
    scheduler._preempt = lambda r: (preempted.append((r.request_id, len(r.output_token_ids))), preempt(r))[1]
    got = tight.generate(prompts, params)

    assert len(preempted) == sum(step.num_preempted for step in steps) == sum(r.num_preemptions for r in requests)
    assert len(preempted) > 0
    assert any(generated > 0 for _, generated in preempted)  # recomputed its own output tokens too
    assert all(r.finished for r in requests)
    assert tight.engine.blocks.num_used_blocks == 0  # every block came back
    for g, w, prompt in zip(got, want, prompts):
        assert g.finished and g.outputs[0].finish_reason == "length"
        assert len(g.outputs[0].token_ids) == 24
        assert g.outputs[0].token_ids == w.outputs[0].token_ids, f"prompt of {len(prompt)} tokens"


# ---- seeded sampling ---------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_and_batch_independent(ckpt_b):
    [target, *others] = _prompts(51, [30, 12, 44, 7, 25])
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=24, logprobs=2, ignore_eos=True)
    other_params = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=20, seed=7, max_tokens=10),
        SamplingParams(temperature=0.5, min_p=0.1, max_tokens=16, repetition_penalty=1.3),
        SamplingParams(temperature=1.0, top_p=0.5, seed=1234, max_tokens=24, ignore_eos=True),  # same seed
    ]
    llm = _llm(ckpt_b)
    [alone] = llm.generate([target], params)
    [again] = llm.generate([target], params)  # second run, now from the prefix cache
    assert again.num_cached_tokens > 0
    mixed = _llm(ckpt_b).generate(others[:2] + [target] + others[2:], other_params[:2] + [params] + other_params[2:])
    in_batch = mixed[2]
    assert in_batch.prompt_token_ids == tuple(target)

    tokens = alone.outputs[0].token_ids
    assert len(tokens) == 24 and len(set(tokens)) > 5
    for out in (again, in_batch):
        _assert_same_logprobs(out.outputs[0], alone.outputs[0])
    # the logprobs are the model's raw ones (before temperature / top-p), as HF computes them
    values, ids = _hf_top_logprobs(ckpt_b.hf_model, target, tokens, VOCAB)
    chosen = [float(v[i.tolist().index(t)]) for v, i, t in zip(values, ids, tokens)]
    torch.testing.assert_close(torch.tensor(alone.outputs[0].token_logprobs), torch.tensor(chosen))
    for mine, hf_ids, hf_values in zip(alone.outputs[0].top_logprobs, ids[:, :2].tolist(), values[:, :2]):
        assert list(mine) == hf_ids
        torch.testing.assert_close(torch.tensor(list(mine.values())), hf_values)
    assert any(c < v[0] - 0.5 for c, v in zip(chosen, values))  # it did sample below the top token
    # it is sampling, not greedy: the seed decides; another seed or greedy gives other tokens
    [other_seed] = llm.generate([target], SamplingParams(temperature=0.8, top_p=0.9, seed=4321, max_tokens=24))
    [greedy] = llm.generate([target], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert other_seed.outputs[0].token_ids != tokens
    assert greedy.outputs[0].token_ids != tokens


# ---- bad input ---------------------------------------------------------------------------------


def test_prompt_longer_than_context_is_rejected(ckpt_a):
    llm = _llm(ckpt_a, max_model_len=64)
    with pytest.raises(RequestError) as info:
        llm.generate(_prompts(61, [80]), SamplingParams(max_tokens=4))
    assert isinstance(info.value, DeepInferError)
    assert "80" in str(info.value) and "64" in str(info.value)
    with pytest.raises(DeepInferError, match=r"\b64\b.*\b64\b"):  # exactly the context leaves no room
        llm.generate(_prompts(62, [64]), SamplingParams(max_tokens=4))
    # all of a batch or none of it: the good prompt next to a bad one is not left behind
    with pytest.raises(DeepInferError, match=r"\b100\b"):
        llm.generate(_prompts(63, [10, 100]), SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished()
    [ok] = llm.generate(_prompts(64, [63]), SamplingParams(temperature=0, max_tokens=4))  # 63 fits
    assert len(ok.outputs[0].token_ids) == 1 and ok.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "field, value",
    [("temperature", -1.0), ("top_p", 0.0), ("top_k", -2)],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"{field} .*got {value:g}") as info:
        SamplingParams(**{field: value})
    others = {"temperature", "top_p", "top_k"} - {field}
    assert not any(name in str(info.value) for name in others)
