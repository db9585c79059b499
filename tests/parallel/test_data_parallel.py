"""The multi-rank engine (deepinfer_core/parallel/data_parallel.py): real rank processes in a gloo world, the
routed experts split between them, against the same model on one rank.

rowwise_cpu computes every row on its own (batch-invariant), so a token's logits do not depend on which rows
share its expert GEMMs on which rank, and the combine sums in routing order: seeded outputs are the one-rank
outputs token for token. World sizes that do not divide the experts (4 experts on 3 ranks, 5 on 2) run with
redundant copies of some experts and tokens spread over the copies."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer_core.errors import DeepInferError, RequestError

V41 = Path(__file__).parents[1] / "fixtures" / "deepseek_v41" / "engram_top1"
PROMPTS = [[5 + i, 17, 33 + 2 * i, 9, 60 - i] for i in range(5)] + [[7] * 3, list(range(10, 40))]


def outputs(model, size: int, stats: list | None = None, **options) -> list[tuple[int, ...]]:
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=i, ignore_eos=True) for i in range(len(PROMPTS))]
    llm = LLM(
        model, accelerator="rowwise_cpu", max_num_seqs=4, progress=False, num_kv_blocks=64,
        data_parallel_size=size, enable_expert_parallel=size > 1, **options,
    )  # fmt: skip
    try:
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        if stats is not None:
            stats.extend(llm.engine.rank_stats())
        return tokens
    finally:
        if size > 1:
            llm.engine.shutdown()


@pytest.mark.parametrize("size", [2, 3, 4])
def test_v3_on_several_ranks_gives_the_one_rank_tokens(tiny_checkpoint, size):
    expected = outputs(tiny_checkpoint, 1)
    assert len({tokens for tokens in expected}) > 1  # the prompts do not all give the same tokens
    assert outputs(tiny_checkpoint, size) == expected


@pytest.mark.parametrize("model", [None, V41], ids=["v4_demo", "v41"])
def test_v4_and_v41_on_several_ranks_give_the_one_rank_tokens(model):
    # the demo model (DeepSeek-V4, hash-routed first MoE layer) and a V4.1 checkpoint with 5 experts (its
    # vocabulary, 338, holds every prompt token): 5 experts on 2, 3 and 4 ranks need redundant copies
    expected = outputs(model, 1)
    for size in (2, 3, 4):
        assert outputs(model, size) == expected, size


def test_eplb_rebalancing_mid_run_changes_no_output(tiny_checkpoint):
    """Experts re-placed (with two redundant copies, weights moved between the ranks) every 2 steps of the run."""
    stats = []
    eplb = {"window_size": 4, "step_interval": 2, "num_redundant_experts": 2}
    moved = outputs(tiny_checkpoint, 2, stats, enable_eplb=True, eplb_config=eplb)
    assert all(rank["rebalances"] >= 3 for rank in stats), stats
    assert moved == outputs(tiny_checkpoint, 1)


def test_eplb_settings_are_checked():
    with pytest.raises(DeepInferError, match="enable_eplb balances experts between ranks"):
        LLM(accelerator="rowwise_cpu", enable_eplb=True)
    with pytest.raises(DeepInferError, match="eplb_config has unknown keys"):
        LLM(accelerator="rowwise_cpu", data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
            eplb_config={"window": 3})  # fmt: skip


def test_a_request_a_rank_refuses_is_a_clear_error_and_the_ranks_go_on(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, accelerator="rowwise_cpu", data_parallel_size=2, enable_expert_parallel=True,
              num_kv_blocks=64, progress=False)  # fmt: skip
    try:
        with pytest.raises(RequestError, match="outside the vocabulary"):
            llm.generate([[5, 6], [10**6]], SamplingParams(max_tokens=2), use_tqdm=False)
        [done] = llm.generate([[5, 6]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert len(done.outputs[0].token_ids) == 3
    finally:
        llm.engine.shutdown()


def test_a_rank_that_cannot_start_is_a_clear_error(tmp_path):
    with pytest.raises(DeepInferError, match=r"engine rank \d could not start: .*no config.json"):
        LLM(str(tmp_path), accelerator="rowwise_cpu", data_parallel_size=2, enable_expert_parallel=True)


def test_speculative_decoding_is_refused_across_ranks(tiny_checkpoint):
    with pytest.raises(DeepInferError, match="speculative decoding does not run with data_parallel_size"):
        LLM(tiny_checkpoint, data_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_a_killed_rank_restarts_the_instance_and_every_request_completes_with_the_same_tokens(tiny_checkpoint):
    """kill -9 of one of 3 ranks mid-run: the instance restarts on the 2 others, every request in flight is
    recomputed, and each request's tokens (as streamed: no token passed on twice) equal an undisturbed run's."""
    import os
    import signal

    expected = outputs(tiny_checkpoint, 1)
    llm = LLM(tiny_checkpoint, accelerator="rowwise_cpu", max_num_seqs=4, progress=False, num_kv_blocks=64,
              data_parallel_size=3, enable_expert_parallel=True)  # fmt: skip
    engine = llm.engine
    try:
        streamed = {str(i): [] for i in range(len(PROMPTS))}
        for i, prompt in enumerate(PROMPTS):  # seeded as outputs() seeds them
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=i, ignore_eos=True))
        killed, finished = False, {}
        while engine.has_unfinished():
            for output in engine.step():
                streamed[output.request_id].extend(output.outputs[0].new_token_ids)
                if output.finished:
                    finished[output.request_id] = output.outputs[0].token_ids
            if not killed and sum(map(len, streamed.values())) >= 12:  # mid-run: some tokens out, most not
                os.kill(engine._processes[1].pid, signal.SIGKILL)
                killed = True
        assert killed and len(engine.restarts) == 1, engine.restarts
        restart = engine.restarts[0]
        assert restart["lost"] == [1] and restart["world_size"] == 2 and restart["requeued"] >= 1, restart
        assert [finished[str(i)] for i in range(len(PROMPTS))] == expected
        assert [tuple(streamed[str(i)]) for i in range(len(PROMPTS))] == expected
    finally:
        engine.shutdown()


def test_losing_every_rank_fails_every_request_with_a_clear_error(tiny_checkpoint):
    import os
    import signal

    from deepinfer_core.engine.request import FailedRequest

    llm = LLM(tiny_checkpoint, accelerator="rowwise_cpu", num_kv_blocks=64, progress=False, data_parallel_size=2,
              enable_expert_parallel=True)  # fmt: skip
    engine = llm.engine
    try:
        engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
        for process in engine._processes:
            os.kill(process.pid, signal.SIGKILL)
        failed = []
        while engine.has_unfinished():
            failed += [o for o in engine.step() if isinstance(o, FailedRequest)]
        assert [f.request_id for f in failed] == ["a"]
        assert "every engine rank was lost" in str(failed[0].error)
        with pytest.raises(DeepInferError, match="every engine rank was lost"):
            engine.add_request("b", [5], SamplingParams(max_tokens=1))
        with pytest.raises(DeepInferError, match="every engine rank was lost"):  # what LLM.generate raises
            llm.generate([[5]], SamplingParams(max_tokens=1), use_tqdm=False)
    finally:
        engine.shutdown()
