"""End-to-end greedy generation on a tiny random DeepSeek-V3 checkpoint: the engine on the backend under
test against the engine on the reference (dense first layer, noaux_tc MoE, MLA with and without q_lora)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.engine.llm import LLM
from deepinfer_core.sampling.params import SamplingParams

PROMPT_LENGTHS = (3, 17, 40, 77)
NEW_TOKENS = 24
TOP = 5  # logprobs compared at each position: those of the reference's top-5 tokens
VOCAB = 512  # the tiny checkpoint's (tiny_v3.TINY_V3)

# bfloat16 thresholds. On the tiny checkpoint the reference in bfloat16, teacher-forced against itself in
# float32 (a stand-in for "another correct bfloat16 implementation"), agrees on ~98% of top-1 tokens, with
# a logprob error of ~0.04 mean / ~0.2-0.3 max over each position's top-5 tokens. Routing is discrete: a
# bfloat16 near-tie between experts can flip one token's experts and change its whole distribution, so a
# few positions may be far off without any bug; those are counted, not averaged. The bounds leave ~2x
# headroom; a real bug (wrong routing rule, masking, rope) costs >1 nat at most positions.
MIN_TOP1_AGREEMENT_BF16 = 0.9  # fraction of teacher-forced positions whose greedy token matches
OFF_LOGPROB_ERR_BF16 = 0.5  # nats: a position is "off" when a reference top-5 token's logprob is further
MAX_OFF_POSITIONS_BF16 = 0.05  # fraction of positions allowed off (or with a top-5 token not in our top-20)
MAX_MEAN_LOGPROB_ERR_BF16 = 0.1  # nats, mean |logprob - reference| over the other positions' top-5 tokens

Q_LORA = pytest.mark.parametrize("q_lora_rank", [None, 32], ids=["q_proj", "q_lora32"])


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def engine(path, backend) -> LLM:
    return LLM(
        model=path,
        backend=backend,
        num_kv_blocks=-(-2048 // backend.kv_layout.block_size) + 8,
        enable_prefix_caching=False,
        progress=False,
    )


def greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=20)


def first_divergence(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@Q_LORA
def test_greedy_float32(suite, check, tiny_v3, q_lora_rank):
    """float32: identical greedy tokens for every prompt, top logprobs within float32 tolerance."""
    ours, ref = suite.pair(torch.float32)
    compare_float32(check, tiny_v3(q_lora_rank), ours, ref)


def test_greedy_float32_fp8_checkpoint(suite, check, tiny_v3_fp8):
    """An FP8 block-quantized checkpoint: kept FP8 by a backend that takes the format, dequantized at load
    for the reference; the same float32 agreement as above."""
    suite.require_declared("weight_formats", "fp8_block", why="the loader dequantizes FP8 weights, as for cpu")
    ours, ref = suite.pair(torch.float32)
    llm = engine(tiny_v3_fp8, ours)
    assert any(type(t).__name__ == "BlockFP8" for t in llm.model.layers[1][1].w.values()), "no weight stayed FP8"
    compare_float32(check, tiny_v3_fp8, ours, ref)


def compare_float32(check, path, ours, ref, ref_path=None) -> None:
    """Greedy tokens and top logprobs of the checkpoint at `path` on `ours` against the reference's (on
    `ref_path` where given: the same model stored another way)."""
    batch = prompts()
    got, want = engine(path, ours).generate(batch, greedy()), engine(ref_path or path, ref).generate(batch, greedy())
    actual, expected, diverged = [], [], []
    for n, g, w in zip(PROMPT_LENGTHS, got, want):
        g, w = g.outputs[0], w.outputs[0]
        agree = first_divergence(g.token_ids, w.token_ids)
        if agree < NEW_TOKENS:
            diverged.append(f"{n}-token prompt at new token {agree} ({g.token_ids[agree]} vs {w.token_ids[agree]})")
        for ours_top, ref_top in zip(g.top_logprobs[:agree], w.top_logprobs[:agree]):
            for token, value in list(ref_top.items())[:TOP]:  # a token missing from ours' top-20 is NaN
                actual.append(ours_top.get(token, float("nan")))
                expected.append(value)
    # logprobs come out of a log-softmax over the whole vocabulary: scale atol for that reduction
    check.close(
        torch.tensor(actual),
        torch.tensor(expected),
        torch.float32,
        reduce_dim=VOCAB,
        what="top logprobs (positions before any divergence)",
    )
    assert not diverged, (
        f"greedy tokens diverge from the reference for {len(diverged)}/{len(got)} prompts: " + "; ".join(diverged)
    )


def teacher_forced(llm: LLM, batch, want) -> tuple[list[list[tuple[int, dict]]], float]:
    """Our (greedy token, top logprobs) at every position of the reference's continuations `want`, each
    predicted from the prompt plus the reference's tokens before it, and the free-running agreement.
    Generates greedily and restarts after each divergence, so agreeing stretches cost one step a token."""
    preds, starts, free_running = [[] for _ in batch], [0] * len(batch), None
    while active := [k for k in range(len(batch)) if starts[k] < NEW_TOKENS]:
        outs = llm.generate(
            [batch[k] + list(want[k].token_ids[: starts[k]]) for k in active],
            [greedy(NEW_TOKENS - starts[k]) for k in active],
        )
        agreed = {
            k: first_divergence(o.outputs[0].token_ids, want[k].token_ids[starts[k] :]) for k, o in zip(active, outs)
        }
        if free_running is None:  # the first round ran free from the prompts alone
            free_running = sum(agreed.values()) / (len(batch) * NEW_TOKENS)
        for k, o in zip(active, outs):
            o, keep = o.outputs[0], min(agreed[k] + 1, NEW_TOKENS - starts[k])  # up to the divergence
            preds[k] += list(zip(o.token_ids[:keep], o.top_logprobs[:keep]))
            starts[k] += keep
    return preds, free_running


@Q_LORA
def test_greedy_bfloat16(suite, check, tiny_v3, q_lora_rank):
    """bfloat16: teacher-forced top-1 agreement and logprob error against the bfloat16 reference."""
    ours, ref = suite.pair(torch.bfloat16)
    path, batch = tiny_v3(q_lora_rank), prompts()
    want = [o.outputs[0] for o in engine(path, ref).generate(batch, greedy())]
    preds, free_running = teacher_forced(engine(path, ours), batch, want)
    agreed, errors, off, worst = 0, [], [], 0.0
    for n, w, pred in zip(PROMPT_LENGTHS, want, preds):
        for i, (token, top) in enumerate(pred):
            agreed += token == w.token_ids[i]
            ref_top = list(w.top_logprobs[i].items())[:TOP]
            errs = [abs(top[t] - v) if t in top else float("inf") for t, v in ref_top]
            worst = max(worst, *(e for e in errs if e != float("inf")), 0.0)
            if max(errs) > OFF_LOGPROB_ERR_BF16:
                off.append(f"{n}-token prompt, new token {i}")
            else:
                errors += errs
    positions = len(batch) * NEW_TOKENS
    agreement, off_fraction = agreed / positions, len(off) / positions
    mean_err = sum(errors) / max(1, len(errors))
    check.metric(
        max_abs_err=worst,
        top1_agreement=agreement,
        mean_logprob_err=mean_err,
        max_logprob_err=worst,
        off_positions=len(off),
        positions=positions,
        free_running_agreement=free_running,
        thresholds={
            "min_top1_agreement": MIN_TOP1_AGREEMENT_BF16,
            "off_logprob_err": OFF_LOGPROB_ERR_BF16,
            "max_off_positions": MAX_OFF_POSITIONS_BF16,
            "max_mean_logprob_err": MAX_MEAN_LOGPROB_ERR_BF16,
        },
    )
    problems = []
    if agreement < MIN_TOP1_AGREEMENT_BF16:
        problems.append(f"top-1 agreement {agreement:.3f} < {MIN_TOP1_AGREEMENT_BF16}")
    if off_fraction > MAX_OFF_POSITIONS_BF16:
        problems.append(
            f"{len(off)} positions with a top-{TOP} logprob off by > {OFF_LOGPROB_ERR_BF16} "
            f"(> {MAX_OFF_POSITIONS_BF16:.0%}): {', '.join(off[:5])}"
        )
    if mean_err > MAX_MEAN_LOGPROB_ERR_BF16:
        problems.append(f"mean logprob error {mean_err:.4f} > {MAX_MEAN_LOGPROB_ERR_BF16}")
    assert not problems, (
        f"bfloat16 generation is off the reference ({positions} teacher-forced positions): " + "; ".join(problems)
    )
