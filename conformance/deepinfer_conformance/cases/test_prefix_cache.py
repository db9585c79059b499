"""Prefix caching on the backend under test: a request that reuses another request's cached KV blocks
generates what it generates from a cold cache (bitwise so when the backend claims batch invariance)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.engine.llm import LLM
from deepinfer_core.sampling.params import SamplingParams

SHARED_BLOCKS = 3  # full KV blocks of prefix the two prompts share
NEW_TOKENS = 16
TOP = 5  # logprobs compared per position when not bitwise: those of the cold run's top-5 tokens
VOCAB = 512  # the tiny checkpoint's (tiny_v3.TINY_V3)
MAX_POSITIONS = 1024
# bfloat16, backends that do not claim batch invariance: a cache hit computes the suffix in another chunk
# shape, which may round some logits differently by a bfloat16 ulp or two (~0.03 nats each at |logit| ~4,
# ~0.07 seen on the reference when the batch shape changes); a wrong or stale cache block costs > 1 nat.
MAX_LOGPROB_DIFF_BF16 = 0.25
# float32 without batch invariance: a different chunk shape moves a logit by a few ulps at most
NEAR_TIE_FP32 = 1e-4


def decided_prefix(cold, margin: float) -> int:
    """How many of the cold run's tokens won by more than `margin` nats over the runner-up (counted up to the
    first near-tie): a run whose logits move by less than `margin` must choose exactly these."""
    for position, top in enumerate(cold.top_logprobs):
        best, second = sorted(top.values(), reverse=True)[:2]
        if best - second <= margin:
            return position
    return len(cold.top_logprobs)


def engine(path, backend, prefix_caching: bool) -> LLM:
    return LLM(
        model=path,
        backend=backend,
        num_kv_blocks=-(-8192 // backend.kv_layout.block_size) + 8,
        enable_prefix_caching=prefix_caching,
        progress=False,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prefix_cache_hit_matches_cold_run(suite, check, tiny_v3, dtype):
    suite.require_dtype(dtype)
    invariant = suite.capabilities.batch_invariant  # claimed: check it in that mode, bit for bit
    ours = suite.resolved(suite.under_test, dtype, batch_invariant=invariant)
    block = ours.kv_layout.block_size
    g = torch.Generator().manual_seed(11)
    # the shared prefix ends half-way into a block: only the SHARED_BLOCKS full blocks can be reused
    prefix = torch.randint(2, VOCAB, (SHARED_BLOCKS * block + block // 2,), generator=g).tolist()
    first = prefix + torch.randint(2, VOCAB, (5,), generator=g).tolist()
    second = prefix + torch.randint(2, VOCAB, (9,), generator=g).tolist()
    if len(second) + NEW_TOKENS > MAX_POSITIONS:
        pytest.skip(f"{SHARED_BLOCKS} blocks of {block} tokens do not fit the tiny model's {MAX_POSITIONS} positions")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=20)
    path = tiny_v3(32)

    warm = engine(path, ours, prefix_caching=True)
    warm.generate(first, params)
    [hit] = warm.generate(second, params)
    [cold] = engine(path, ours, prefix_caching=False).generate(second, params)

    assert hit.num_cached_tokens > 0, "the second prompt found nothing in the prefix cache"
    assert hit.num_cached_tokens >= SHARED_BLOCKS * block, (
        f"only {hit.num_cached_tokens} cached tokens; {SHARED_BLOCKS} full blocks of {block} are shared"
    )
    h, c = hit.outputs[0], cold.outputs[0]
    # without batch invariance, a greedy near-tie may go either way (the CPU's GEMM blocking decides): the
    # tokens must agree up to the first one, and the logprobs are compared up to it, on equal contexts
    margin = 0 if invariant else MAX_LOGPROB_DIFF_BF16 if dtype == torch.bfloat16 else NEAR_TIE_FP32
    decided = len(c.token_ids) if invariant else decided_prefix(c, 2 * margin)
    assert h.token_ids[:decided] == c.token_ids[:decided], (
        f"tokens after a prefix-cache hit differ from a cold run: {list(h.token_ids)} vs {list(c.token_ids)}"
    )
    if invariant:  # the cache hit must not change a single bit
        check.equal(
            torch.tensor([list(t) for t in h.top_logprobs]),
            torch.tensor([list(t) for t in c.top_logprobs]),
            what="top-20 token ids",
        )
        check.equal(
            torch.tensor([list(t.values()) for t in h.top_logprobs]),
            torch.tensor([list(t.values()) for t in c.top_logprobs]),
            what="top-20 logprobs",
        )
        check.equal(torch.tensor(h.token_logprobs), torch.tensor(c.token_logprobs), what="chosen-token logprobs")
    else:
        compared = list(zip(h.top_logprobs, c.top_logprobs))[: decided + 1]  # the near-tie's own logprobs too
        actual = [ht.get(t, float("nan")) for ht, ct in compared for t in list(ct)[:TOP]]
        expected = [v for _, ct in compared for v in list(ct.values())[:TOP]]
        if dtype == torch.float32:
            check.close(torch.tensor(actual), torch.tensor(expected), dtype, reduce_dim=VOCAB, what="top logprobs")
        else:  # a different chunk shape may round a bfloat16 logit differently: bound the error in nats
            worst = float((torch.tensor(actual) - torch.tensor(expected)).abs().nan_to_num(float("inf")).max())
            check.metric(max_abs_err=worst, bound=MAX_LOGPROB_DIFF_BF16)
            assert worst <= MAX_LOGPROB_DIFF_BF16, (
                f"top logprobs after a prefix-cache hit differ from a cold run "
                f"by up to {worst:.3g} nats (bound {MAX_LOGPROB_DIFF_BF16})"
            )
