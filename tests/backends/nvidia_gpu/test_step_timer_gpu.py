"""On a GPU only (skipped elsewhere; CI has none): nvidia_sm100's step timer (CUDA events) and an engine with
adaptive verification, which profiles verify steps with it at start-up, on the tiny DeepSeek-V3 in float32."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (the CPU tests check the timer's contract)", allow_module_level=True)

from deepinfer_core.engine.llm import LLM  # noqa: E402
from deepinfer_core.sampling.params import SamplingParams  # noqa: E402
from deepinfer_nvidia_sm100.timing import CudaEventStepTimer  # noqa: E402

LOOP = [5, 6, 7, 8, 9] * 6


def test_device_events_time_a_step():
    x = torch.randn(1024, 1024, device="cuda")
    calls = []

    def step() -> torch.Tensor:
        calls.append(1)
        return x @ x

    assert CudaEventStepTimer(x.device).time(step, runs=3) > 0
    assert len(calls) == 4  # one warm-up, three timed


def test_an_adaptive_engine_profiles_and_keeps_the_output(mtp_checkpoint):
    def run(speculative):
        llm = LLM(model=mtp_checkpoint, accelerator="nvidia", dtype="float32", block_size=16, progress=False,
                  max_num_seqs=8, speculative_config=speculative)  # fmt: skip
        params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                  SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)]  # fmt: skip
        return llm, [o.outputs[0].token_ids for o in llm.generate([LOOP, LOOP[2:]], params, use_tqdm=False)]

    _, want = run(None)
    spec, got = run({"method": "mtp", "num_speculative_tokens": 3, "verify": "adaptive"})
    table = spec.engine.scheduler.step_costs
    print(table)
    assert isinstance(spec.backend.step_timer, CudaEventStepTimer)
    assert table.tokens[-1] == 8 * (3 + 1) and all(s > 0 for s in table.seconds)
    assert got == want
