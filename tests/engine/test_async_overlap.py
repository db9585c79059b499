"""Asynchronous scheduling really overlaps: step N+1 is issued before the host reads any value step N
sampled. Also when it is on, and that an abort or the end of the work finds no step left behind."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer_core.engine.engine import Engine, EngineConfig
from deepinfer_core.engine.llm import LLM
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.sampling.sampler import SampleOutput

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py

# Tensor methods that hand a tensor's values to Python: the host waits for the device there
HOST_READS = {
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
}


class Watched(torch.Tensor):
    """A tensor that logs ("read", step) whenever the host reads its values (or those of any tensor
    computed from it), `step` being the engine step that sampled it."""

    events: list
    step: int

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        sources = [a for a in args if isinstance(a, Watched) and hasattr(a, "step")]
        if sources and func in HOST_READS:
            sources[0].events.append(("read", sources[0].step))
        result = super().__torch_function__(func, types, args, kwargs or {})
        if sources and isinstance(result, Watched):  # what is computed from it is watched too
            result.events, result.step = sources[0].events, sources[0].step
        return result


def watch(tensor: torch.Tensor, events: list, step: int) -> Watched:
    watched = tensor.as_subclass(Watched)
    watched.events, watched.step = events, step
    return watched


def record_steps(llm: LLM) -> list:
    """("issue", k) when step k's model runs, ("read", k) when the host reads what step k sampled."""
    events: list = []
    runner, sampler = llm.engine.runner, llm.engine.runner.sampler
    run_model = runner.run_model

    def recording_run_model(batch):
        events.append(("issue", sum(kind == "issue" for kind, _ in events)))
        return run_model(batch)

    class WatchingSampler:
        def sample(self, logits, batch) -> SampleOutput:
            out = sampler.sample(logits, batch)
            step = events[-1][1]
            return SampleOutput(*(watch(getattr(out, f.name), events, step) for f in dataclasses.fields(out)))

    runner.run_model, runner.sampler = recording_run_model, WatchingSampler()
    return events


WORKLOAD = [
    ([5, 6, 7], SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)),
    ([9, 8, 7, 6, 5], SamplingParams(temperature=0.8, seed=3, max_tokens=5, repetition_penalty=1.2, ignore_eos=True)),
    (list(range(10, 40)), SamplingParams(temperature=0, max_tokens=4, presence_penalty=0.5, ignore_eos=True)),
]


def _run(tiny_checkpoint, async_scheduling: bool):
    llm = LLM(
        model=tiny_checkpoint, accelerator="cpu", block_size=16, progress=False, async_scheduling=async_scheduling
    )
    events = record_steps(llm)
    outputs = llm.generate([p for p, _ in WORKLOAD], [s for _, s in WORKLOAD])
    return events, [o.outputs[0] for o in outputs]


def _issued_before_read(events: list) -> list[bool]:
    """For each step k that sampled, but the last: was step k+1 issued before anything of step k was read?"""
    issued = {step: i for i, (kind, step) in enumerate(events) if kind == "issue"}
    first_read = {}
    for i, (kind, step) in enumerate(events):
        if kind == "read":
            first_read.setdefault(step, i)
    assert first_read, "nothing sampled was ever read: the recording is broken"
    return [issued[k + 1] < first_read[k] for k in sorted(first_read) if k + 1 in issued]


def test_the_next_step_is_issued_before_this_steps_tokens_are_read(tiny_checkpoint):
    events, outputs = _run(tiny_checkpoint, async_scheduling=True)
    overlapped = _issued_before_read(events)
    assert len(overlapped) >= 5 and all(overlapped), events
    # the control: synchronous scheduling reads every step's tokens before it issues the next step
    sync_events, sync_outputs = _run(tiny_checkpoint, async_scheduling=False)
    assert not any(_issued_before_read(sync_events)), sync_events
    assert outputs == sync_outputs


def test_async_scheduling_follows_the_backend_unless_told(tiny_checkpoint):
    llm = LLM(model=tiny_checkpoint, accelerator="cpu", block_size=16, progress=False)
    assert llm.backend.capabilities.async_scheduling is False and llm.engine.async_scheduling is False
    capable = dataclasses.replace(
        llm.backend, capabilities=dataclasses.replace(llm.backend.capabilities, async_scheduling=True)
    )
    assert LLM(model=tiny_checkpoint, backend=capable, progress=False).engine.async_scheduling is True
    assert (
        LLM(model=tiny_checkpoint, backend=capable, progress=False, async_scheduling=False).engine.async_scheduling
        is False
    )


@pytest.mark.parametrize("abort_at", [1, 2, 3])
def test_aborting_everything_with_a_step_in_flight(tiny_checkpoint, abort_at):
    llm = LLM(model=tiny_checkpoint, accelerator="cpu", block_size=16, progress=False, async_scheduling=True)
    engine = llm.engine
    engine.add_request("a", list(range(2, 40)), SamplingParams(temperature=0, max_tokens=50))
    engine.add_request("b", [5, 6, 7], SamplingParams(temperature=0.5, seed=1, max_tokens=50))
    reported = [o for _ in range(abort_at) for o in engine.step()]
    assert len(reported) == 2 * (abort_at - 1)  # a step's tokens are reported by the next call
    engine.abort("a")
    engine.abort("b")
    assert engine.has_unfinished()  # a step is still in flight: its outputs are due (and dropped)
    assert engine.step() == []
    assert not engine.has_unfinished()
    assert engine.blocks.num_used_blocks == 0


def test_logits_processors_make_the_engine_synchronous(tiny_checkpoint):
    """A logits processor reads the output tokens on the host, so every one of them must be there."""
    llm = LLM(model=tiny_checkpoint, accelerator="cpu", block_size=16, progress=False)
    seen = []

    def processor(prompt_token_ids, output_token_ids, logits):
        seen.append(list(output_token_ids))
        return logits

    engine = Engine(llm.model, llm.backend, None, EngineConfig(async_scheduling=True), logits_processors=[processor])
    assert engine.async_scheduling is False
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    outputs = [o for _ in range(4) for o in engine.step()]
    assert [o.new_token_ids[0] for o in outputs] == list(outputs[-1].outputs[0].token_ids)
    assert seen == [list(outputs[-1].outputs[0].token_ids[:i]) for i in range(4)]  # never a token short
