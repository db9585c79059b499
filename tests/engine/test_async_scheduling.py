"""Asynchronous scheduling gives what synchronous scheduling gives: one mixed workload (greedy and seeded
sampling, penalties, stop tokens, EOS, stop strings, max_tokens and the context limit, chunked prefill,
prefix-cache hits, preemption, an abort, requests arriving mid-run) run both ways on a tiny checkpoint."""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from dataclasses import dataclass

import pytest
import torch

from deepinfer_core.engine.block_manager import hash_block
from deepinfer_core.engine.llm import LLM
from deepinfer_core.engine.scheduler import ScheduledStep
from deepinfer_core.engine.tokenizer import demo_tokenizer_dir
from deepinfer_core.sampling.params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py

BLOCK = 16


@dataclass(frozen=True)
class Arrival:
    step: int  # added before this engine.step() call
    request_id: str
    prompt: list[int] | str
    params: SamplingParams


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(2, 128, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _llm(checkpoint, accelerator: str, async_scheduling: bool, **kwargs) -> LLM:
    llm = LLM(
        model=checkpoint,
        accelerator=accelerator,
        block_size=BLOCK,
        progress=False,
        async_scheduling=async_scheduling,
        **kwargs,
    )
    assert llm.engine.async_scheduling is async_scheduling
    return llm


@dataclass
class Run:
    finals: dict  # request id -> its finished RequestOutput
    streamed: dict  # request id -> (token ids, text) as reported step by step
    preempted: list  # (request id, tokens still in flight) at each preemption
    steps: list  # every ScheduledStep


def _drive(llm: LLM, arrivals: list[Arrival], abort_after: dict[str, int] | None = None) -> Run:
    """Feed arrivals between steps, abort a request once it reported that many tokens, run to the end."""
    engine, scheduler = llm.engine, llm.engine.scheduler
    run = Run({}, defaultdict(lambda: ([], [])), [], [])
    preempt, schedule = scheduler._preempt, scheduler.schedule
    scheduler._preempt = lambda r: (run.preempted.append((r.request_id, r.num_pending_tokens)), preempt(r))[1]

    def scheduling(*args) -> ScheduledStep:
        step = schedule(*args)
        run.steps.append(step)
        for request, count in step.requests:  # the last token is sampled, never fed back: no KV for it
            assert request.num_computed_tokens + count < request.max_num_tokens, request.request_id
        return step

    scheduler.schedule = scheduling
    abort_after = abort_after or {}
    step = 0
    while step <= max(a.step for a in arrivals) or engine.has_unfinished():
        for arrival in arrivals:
            if arrival.step == step:
                engine.add_request(arrival.request_id, arrival.prompt, arrival.params)
        for output in engine.step():
            tokens, text = run.streamed[output.request_id]
            tokens += output.new_token_ids
            text.append(output.new_text)
            if output.finished:
                run.finals[output.request_id] = output
            elif len(tokens) == abort_after.get(output.request_id):
                engine.abort(output.request_id)
        step += 1
        for request in scheduler.running:  # the prefix cache holds only blocks whose tokens were all known
            parent = None
            for i, block_hash in enumerate(request.block_hashes):
                parent = hash_block(parent, request.all_token_ids[i * BLOCK : (i + 1) * BLOCK])
                assert block_hash == parent, request.request_id
    assert engine.blocks.num_used_blocks == 0  # every block came back
    assert not engine.scheduler.running and not engine.scheduler.waiting
    return run


def _assert_same(got: Run, want: Run, bitwise: bool) -> None:
    """Per request: the same final output, and the same tokens and text reported along the way."""
    assert got.finals.keys() == want.finals.keys()
    for request_id, expected in want.finals.items():
        mine, theirs = got.finals[request_id].outputs[0], expected.outputs[0]
        assert (mine.token_ids, mine.text) == (theirs.token_ids, theirs.text), request_id
        assert (mine.finish_reason, mine.stop_reason) == (theirs.finish_reason, theirs.stop_reason), request_id
        if bitwise:  # a batch-invariant backend: nothing may differ, not a bit
            assert mine == theirs, request_id
        elif theirs.token_logprobs is not None:  # the batches differ (a stopped request runs one step more)
            torch.testing.assert_close(torch.tensor(mine.token_logprobs), torch.tensor(theirs.token_logprobs))
            for a, b in zip(mine.top_logprobs, theirs.top_logprobs, strict=True):
                assert list(a) == list(b), request_id
                torch.testing.assert_close(torch.tensor(list(a.values())), torch.tensor(list(b.values())))
        else:
            assert mine.token_logprobs is None and mine.top_logprobs is None
    assert {k: (v[0], "".join(v[1])) for k, v in got.streamed.items()} == {
        k: (v[0], "".join(v[1])) for k, v in want.streamed.items()
    }


def _workload(stop_token: int | None) -> list[Arrival]:
    greedy = dict(temperature=0, ignore_eos=True)
    top_p = SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=7, max_tokens=30, logprobs=2, ignore_eos=True)
    penalties = SamplingParams(
        temperature=0.8, seed=9, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4, max_tokens=25
    )
    greedy_penalty = SamplingParams(**greedy, repetition_penalty=1.5, frequency_penalty=0.3, max_tokens=20)
    stop = SamplingParams(**greedy, max_tokens=30, stop_token_ids=() if stop_token is None else (stop_token,))
    late = SamplingParams(temperature=1.1, min_p=0.05, seed=14, max_tokens=17, logprobs=5, ignore_eos=True)
    prefix = _prompt(100, 40)  # two full blocks and a half, shared by two requests
    return [
        # stops at the context (max_model_len 80) before max_tokens; its prompt is prefilled in chunks
        Arrival(0, "context", _prompt(1, 50), SamplingParams(**greedy, max_tokens=40, logprobs=3)),
        Arrival(0, "top-p", _prompt(2, 23), top_p),
        Arrival(0, "penalties", _prompt(3, 12), penalties),  # may stop at EOS too
        Arrival(0, "greedy-penalty", _prompt(4, 9), greedy_penalty),
        Arrival(1, "stop-token", _prompt(5, 17), stop),
        Arrival(2, "eos", _prompt(6, 14), SamplingParams(temperature=0.7, seed=11, max_tokens=30)),
        Arrival(3, "prefix-a", prefix + _prompt(7, 5), SamplingParams(**greedy, max_tokens=6)),
        Arrival(4, "to-abort", _prompt(8, 20), SamplingParams(**greedy, max_tokens=40)),
        Arrival(5, "one-token", _prompt(9, 7), SamplingParams(**greedy, max_tokens=1)),
        Arrival(5, "two-tokens", _prompt(10, 3), SamplingParams(temperature=1.0, seed=12, max_tokens=2)),
        Arrival(9, "prefix-b", prefix + _prompt(11, 9), SamplingParams(temperature=0.6, seed=13, max_tokens=10)),
        Arrival(12, "late", _prompt(12, 40), late),
    ]


ENGINE = dict(num_kv_blocks=12, max_num_batched_tokens=24, max_model_len=80)
ABORT = {"to-abort": 5}


@pytest.mark.parametrize("accelerator", ["cpu", "rowwise_cpu"])
def test_async_scheduling_gives_the_synchronous_results(tiny_checkpoint, accelerator):
    # a synchronous probe run picks a stop token and an EOS token that really occur mid-generation
    probe = _drive(_llm(tiny_checkpoint, accelerator, False, **ENGINE), _workload(None), ABORT)
    stop_token = probe.finals["stop-token"].outputs[0].token_ids[4]
    eos = probe.finals["eos"].outputs[0].token_ids[3]
    runs = {}
    for async_scheduling in (False, True):
        llm = _llm(tiny_checkpoint, accelerator, async_scheduling, **ENGINE)
        llm.engine.eos_token_ids = frozenset({eos})
        runs[async_scheduling] = _drive(llm, _workload(stop_token), ABORT)
    want, got = runs[False], runs[True]

    # the workload does what it says, both ways
    for run in (want, got):
        outputs = {k: v.outputs[0] for k, v in run.finals.items()}
        assert (outputs["stop-token"].finish_reason, outputs["stop-token"].stop_reason) == ("stop", stop_token)
        assert len(outputs["stop-token"].token_ids) < 30
        assert (outputs["eos"].finish_reason, outputs["eos"].stop_reason) == ("stop", None)
        assert outputs["eos"].token_ids[-1] == eos and len(outputs["eos"].token_ids) < 30
        assert len(outputs["context"].token_ids) == 80 - 50 and outputs["context"].finish_reason == "length"
        assert [len(outputs[k].token_ids) for k in ("one-token", "two-tokens", "late")] == [1, 2, 17]
        assert "to-abort" not in run.finals and len(run.streamed["to-abort"][0]) == ABORT["to-abort"]
        assert run.finals["prefix-b"].num_cached_tokens >= 2 * BLOCK
        assert run.preempted and all(step.num_tokens <= 24 for step in run.steps)
        assert any(r.request_id == "context" and 1 < n < 50 for s in run.steps for r, n in s.requests)
    assert any(pending for _, pending in got.preempted)  # preempted with a token in flight
    _assert_same(got, want, bitwise=llm.backend.capabilities.batch_invariant)
    assert (accelerator == "rowwise_cpu") == llm.backend.capabilities.batch_invariant


@pytest.fixture(scope="module")
def text_checkpoint(tmp_path_factory, tiny_checkpoint):
    """The tiny checkpoint with the DeepSeek-V4 tokenizer and a vocabulary to match it."""
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


def test_stop_strings_cut_the_same_text(text_checkpoint):
    def workload(stops: dict[str, tuple[str, ...]]) -> list[Arrival]:
        sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=16, stop=stops["sampled"], logprobs=2)
        return [
            Arrival(0, "greedy", "Hello there", SamplingParams(temperature=0, max_tokens=16, stop=stops["greedy"])),
            Arrival(1, "sampled", "Once upon", sampled),
            Arrival(1, "free", "A third one", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
        ]

    probe = _drive(_llm(text_checkpoint, "cpu", False), workload({"greedy": (), "sampled": ()}))
    texts = {k: probe.finals[k].outputs[0].text for k in ("greedy", "sampled")}
    assert all(len(t) > 8 for t in texts.values()), texts
    stops = {k: (t[3:6], "never in the text") for k, t in texts.items()}
    runs = {a: _drive(_llm(text_checkpoint, "cpu", a), workload(stops)) for a in (False, True)}
    for run in runs.values():
        for key, text in texts.items():
            out = run.finals[key].outputs[0]
            assert out.text == text[: text.index(stops[key][0])]
            assert (out.finish_reason, out.stop_reason) == ("stop", stops[key][0])
    _assert_same(runs[True], runs[False], bitwise=False)
