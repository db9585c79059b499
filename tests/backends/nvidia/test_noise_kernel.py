"""The Gumbel noise kernel returns the bits of core's counter-based definition, under Triton's interpreter."""

from __future__ import annotations

import torch

from deepinfer_core.sampling import noise as core
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.sampling.sampler import SamplingBatch, TorchSampler
from deepinfer_nvidia_sm100.kernels.noise import gumbel_noise

# seeds across the whole uint64 range (as int64 bits) and steps past 2**31
SEEDS = torch.tensor([0, 1, 2**63 - 1, -5, -(2**63), 1234567890123], dtype=torch.int64)
STEPS = torch.tensor([0, 7, 1000, 3, 2**31 + 5, 65535], dtype=torch.int64)


def test_noise_is_bitwise_core_definition():
    assert torch.equal(gumbel_noise(SEEDS, STEPS, 3001), core.gumbel_noise(SEEDS, STEPS, 3001))


def test_noise_depends_on_seed_step_and_token():
    noise = gumbel_noise(SEEDS, STEPS, 64)
    assert len({tuple(row.tolist()) for row in noise}) == len(SEEDS)
    assert noise[0].unique().numel() == 64


def test_sampler_with_the_kernel_picks_the_reference_tokens():
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(0))
    settings = ((0.7, 0, 1), (1.3, 50, 2), (0.0, 0, 3), (1.0, 5, 4))  # (temperature, top_k, seed)
    params = [SamplingParams(temperature=t, top_k=k, seed=s) for t, k, s in settings]
    batch = SamplingBatch.build(params, [p.seed for p in params], [[1, 2]] * 4, [[3]] * 4)
    ours, ref = TorchSampler(noise=gumbel_noise).sample(logits, batch), TorchSampler().sample(logits, batch)
    assert torch.equal(ours.token_ids, ref.token_ids)
