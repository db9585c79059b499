"""On a GPU only (skipped elsewhere; CI has none): speculative decoding on nvidia_sm100 (ngram and MTP drafts,
verify steps through the prefill kernels) gives the tokens of plain decoding on the same GPU, on the tiny
DeepSeek-V3 with an MTP layer, a tiny V4 with one and a tiny V4.1 with DSpark layers, in float32 (where a near-tie
between two tokens is unlikely to flip)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (speculative decoding is checked on the CPU backends elsewhere)",
                allow_module_level=True)  # fmt: skip

from deepinfer_core.engine.llm import LLM  # noqa: E402
from deepinfer_core.sampling.params import SamplingParams  # noqa: E402

LOOP = [5, 6, 7, 8, 9] * 6


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_speculative_tokens_are_plain_decodings_on_the_gpu(mtp_checkpoint, method):
    def run(speculative):
        llm = LLM(model=mtp_checkpoint, accelerator="nvidia", dtype="float32", block_size=16, progress=False,
                  speculative_config=speculative)  # fmt: skip
        params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                  SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)]  # fmt: skip
        return llm, [o.outputs[0].token_ids for o in llm.generate([LOOP, LOOP[2:]], params, use_tqdm=False)]

    _, want = run(None)
    spec, got = run({"method": method, "num_speculative_tokens": 3, "prompt_lookup_max": 3} if method == "ngram"
                    else {"method": method, "num_speculative_tokens": 3})  # fmt: skip
    assert got == want
    assert spec.engine.spec_stats.num_draft_tokens > 0


@pytest.mark.parametrize("verify", ["fixed", "adaptive"])
def test_dspark_and_v4_mtp_tokens_are_plain_decodings_on_the_gpu(tmp_path, hf_v4_mtp_checkpoint, verify):
    """DeepSeek-V4.1 with its DSpark layers (block_attention on the GPU, drafts and confidences) and DeepSeek-V4
    with its MTP layer: the tokens of plain decoding, greedy and seeded, fixed and adaptive verification."""
    from tests.engine.test_speculative_dspark import DSPARK
    from tests.model.v41_checkpoints import write_checkpoint

    v41 = write_checkpoint(tmp_path / "v41", DSPARK, seed=5)
    for checkpoint, method in ((v41, "dspark"), (hf_v4_mtp_checkpoint.path, "mtp")):

        def run(speculative, checkpoint=checkpoint):
            llm = LLM(model=str(checkpoint), accelerator="nvidia", dtype="float32", block_size=16, progress=False,
                      num_kv_blocks=64, speculative_config=speculative)  # fmt: skip
            params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                      SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)]  # fmt: skip
            return llm, [o.outputs[0].token_ids for o in llm.generate([LOOP, LOOP[2:]], params, use_tqdm=False)]

        _, want = run(None)
        spec, got = run({"method": method, "num_speculative_tokens": 4, "verify": verify})
        assert got == want, method
        assert spec.engine.spec_stats.num_draft_tokens > 0, method
        graphs = spec.engine.runner.graphs
        assert graphs is not None and max(q for _, q, _ in graphs._replays) > 1, "verify steps ran eagerly"


@pytest.mark.parametrize("model", ["v4", "v41"])
def test_padded_verify_steps_replay_cuda_graphs(tmp_path, hf_v4_checkpoint, model):
    """Drafts of 0..4 tokens, partly right (tests/engine/test_verify_graphs.py's): verify steps padded to their most
    tokens replay CUDA graphs, planned on the device, and give plain decoding's tokens."""
    from tests.engine.test_verify_graphs import UnevenDrafts
    from tests.model.v41_checkpoints import SCHEDULES, write_checkpoint

    path = hf_v4_checkpoint("a").path if model == "v4" else write_checkpoint(
        tmp_path / "v41", SCHEDULES["groups_and_candidates"], seed=3)  # fmt: skip
    prompts = [LOOP, LOOP[2:], list(range(30, 51))]
    params = [SamplingParams(temperature=0, max_tokens=18, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=4, max_tokens=15, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]  # fmt: skip

    def run(speculative, proposer=None):
        llm = LLM(model=str(path), accelerator="nvidia", dtype="float32", block_size=16, progress=False,
                  num_kv_blocks=64, speculative_config=speculative)  # fmt: skip
        if proposer is not None:
            llm.engine.scheduler.proposer = proposer
        return llm, {o.request_id: o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)}

    _, want = run(None)
    spec, got = run({"method": "ngram", "num_speculative_tokens": 4}, UnevenDrafts(want))
    assert got == want
    assert {q for _, q, _ in spec.engine.runner.graphs._replays} > {1}, "no verify step replayed a graph"
    stats = spec.engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.parametrize("method", ["dspark", "mtp-v4", "mtp-v3"])
def test_pipelined_verify_steps_give_plain_decodings_on_the_gpu(
    tmp_path, hf_v4_mtp_checkpoint, mtp_checkpoint, method, monkeypatch
):
    """Asynchronous scheduling while speculating (nvidia_sm100's default): steps planned while the step before is
    in flight take their tokens and drafts on the device and move positions by the accepted count, in CUDA graphs.
    The drafts are TableDrafts' (partly plain's continuation, so runs of them are accepted)."""
    from tests.engine.test_speculative_async import TableDrafts, spy_pipelined, spy_ran_ahead
    from tests.engine.test_speculative_dspark import DSPARK
    from tests.model.v41_checkpoints import write_checkpoint

    path, vocab = {
        "dspark": (lambda: write_checkpoint(tmp_path / "v41", DSPARK, seed=5), 338),
        "mtp-v4": (lambda: hf_v4_mtp_checkpoint.path, 256),
        "mtp-v3": (lambda: mtp_checkpoint, 128),
    }[method]
    path = str(path())
    prompts = [LOOP, LOOP[2:], [11, 3, 17, 9, 40, 2, 21]]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=17, ignore_eos=True)]  # fmt: skip

    def llm(speculative):
        return LLM(model=path, accelerator="nvidia", dtype="float32", block_size=16, progress=False, num_kv_blocks=64,
                   speculative_config=speculative)  # fmt: skip

    want = [o.outputs[0].token_ids for o in llm(None).generate(prompts, params, use_tqdm=False)]
    spec = llm({"method": method.split("-")[0], "num_speculative_tokens": 3})
    assert spec.engine.async_scheduling
    TableDrafts(spec.engine.runner.drafter, prompts, want, vocab, device="cuda")
    pipelined, ran_ahead = spy_pipelined(monkeypatch), spy_ran_ahead(monkeypatch)
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert any(pipelined) and any(a for a in ran_ahead if a), "no pipelined step ran past accepted drafts"
    graphs = spec.engine.runner.graphs
    assert graphs is not None and max(q for _, q, _ in graphs._replays) > 1, "verify steps ran eagerly"


@pytest.mark.parametrize("model", ["v3", "v41"])
def test_verify_steps_give_decode_steps_logprobs_bit_for_bit_in_batch_invariant_mode(tmp_path, mtp_checkpoint, model):
    """Batch-invariant mode (fixed-tiling GEMMs, row-local kernels), bfloat16: a position's logits in a verify step
    (drafts beside it, other requests around it) are bitwise its logits in plain decoding's single-token step, so
    every logprob of the speculative run equals plain decoding's, greedy and seeded."""
    from tests.engine.test_speculative_dspark import DSPARK
    from tests.model.v41_checkpoints import write_checkpoint

    path = mtp_checkpoint if model == "v3" else str(write_checkpoint(tmp_path / "v41", DSPARK, seed=5))
    prompts = [LOOP, LOOP[2:], LOOP[:13]]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5),
              SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True, logprobs=5),
              SamplingParams(temperature=0, max_tokens=17, ignore_eos=True, logprobs=5)]  # fmt: skip

    def run(speculative):
        llm = LLM(model=path, accelerator="nvidia", dtype="bfloat16", block_size=16, progress=False, num_kv_blocks=64,
                  batch_invariant=True, speculative_config=speculative)  # fmt: skip
        return llm, [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    _, want = run(None)
    spec, got = run({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    # every verify step's first position (and its accepted drafts') comes out of a multi-token step
    assert spec.engine.spec_stats.num_draft_tokens > 0, "nothing was drafted: no verify step was compared"
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        for gp, wp in zip(g.logprobs, w.logprobs):
            assert {t: p.logprob for t, p in gp.items()} == {t: p.logprob for t, p in wp.items()}
