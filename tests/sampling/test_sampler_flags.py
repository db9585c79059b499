"""SamplingBatch's host-side flags: right for the parameters, exact when they skip work, and what lets
the sampler run without reading a device value on the host."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.sampling.sampler import SamplingBatch, TorchSampler

VOCAB = 50
GREEDY = SamplingParams(temperature=0)
RANDOM = SamplingParams(temperature=0.7)
TOP_K = SamplingParams(temperature=0.7, top_k=5)
TOP_P = SamplingParams(temperature=0.7, top_p=0.8)
MIN_P = SamplingParams(temperature=0.7, min_p=0.1)
GREEDY_FILTERED = SamplingParams(temperature=0, top_k=3)  # greedy ignores the filter, but it is asked for
REPETITION = SamplingParams(temperature=0, repetition_penalty=1.2)
PRESENCE = SamplingParams(temperature=0.7, presence_penalty=-0.5)
FREQUENCY = SamplingParams(temperature=0, frequency_penalty=0.3)


def build(params: list[SamplingParams]) -> SamplingBatch:
    rows = len(params)
    prompts = [[3, 4, 4, 9][: 1 + i % 4] for i in range(rows)]
    outputs = [[4, 7, 7, 7, 12][: i % 6] for i in range(rows)]
    return SamplingBatch.build(params, [11 + i for i in range(rows)], prompts, outputs)


@pytest.mark.parametrize(
    "params, flags",
    [
        ([GREEDY, GREEDY], (False, False, False)),
        ([GREEDY, RANDOM], (True, False, False)),
        ([GREEDY, TOP_K], (True, True, False)),
        ([TOP_P], (True, True, False)),
        ([MIN_P, GREEDY], (True, True, False)),
        ([GREEDY_FILTERED], (False, True, False)),
        ([GREEDY, REPETITION], (False, False, True)),
        ([PRESENCE], (True, False, True)),
        ([FREQUENCY, GREEDY], (False, False, True)),
        ([SamplingParams(temperature=0, top_k=-1, top_p=1.0, min_p=0.0)], (False, False, False)),
    ],
)
def test_flags_follow_the_parameters(params, flags):
    batch = build(params)
    assert (batch.any_random, batch.any_filter, batch.any_penalty) == flags


BATCHES = [
    [GREEDY, GREEDY, GREEDY],
    [GREEDY, RANDOM, RANDOM],
    [RANDOM, TOP_K, TOP_P, MIN_P],
    [GREEDY, REPETITION, FREQUENCY],
    [PRESENCE, RANDOM, GREEDY_FILTERED, REPETITION],
    [SamplingParams(temperature=1.0, min_p=0.3)] * 8,  # each flag alone, where it changes tokens
    [SamplingParams(temperature=1.0, top_k=2)] * 8,
    [SamplingParams(temperature=1.0, top_p=0.3)] * 8,
    [SamplingParams(temperature=0, frequency_penalty=2.0)] * 6,
    [SamplingParams(temperature=0, presence_penalty=2.0)] * 6,
    [SamplingParams(temperature=0, repetition_penalty=2.0)] * 6,
]


@pytest.mark.parametrize("params", BATCHES)
def test_skipping_by_the_flags_changes_no_bit(params):
    """The flags only skip work that would not change anything: forcing every step on gives the same bits."""
    batch = build(params)
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(len(params))) * 3
    logits[:, 7] += 6  # a token of the outputs leads by a margin a penalty can overturn
    everything = dataclasses.replace(batch, any_random=True, any_filter=True, any_penalty=True)
    fast, full = TorchSampler().sample(logits, batch), TorchSampler().sample(logits, everything)
    for field in dataclasses.fields(fast):
        assert torch.equal(getattr(fast, field.name), getattr(full, field.name)), field.name


def test_a_batch_made_directly_defaults_to_doing_everything():
    batch = build([GREEDY])
    direct = SamplingBatch(*(getattr(batch, f.name) for f in dataclasses.fields(batch) if not f.name.startswith("any")))
    assert (direct.any_random, direct.any_filter, direct.any_penalty) == (True, True, True)


class DeviceOnly(torch.Tensor):
    """A tensor whose values the host may not read (as if they were still being computed on a device)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        reads = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__}
        if func in reads:
            raise AssertionError(f"the host read a device value ({func.__name__})")
        return super().__torch_function__(func, types, args, kwargs or {})


def device_only(batch: SamplingBatch) -> SamplingBatch:
    tensors = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return dataclasses.replace(
        batch, **{k: v.as_subclass(DeviceOnly) for k, v in tensors.items() if isinstance(v, torch.Tensor)}
    )


@pytest.mark.parametrize("params", BATCHES)
def test_the_sampler_never_reads_a_device_value(params):
    batch = device_only(build(params))
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(5)).as_subclass(DeviceOnly)
    out = TorchSampler().sample(logits, batch)
    assert out.token_ids.shape == (len(params),)
    with pytest.raises(AssertionError, match="read a device value"):  # the control: reading one is caught
        bool((batch.temperature > 0).any())
