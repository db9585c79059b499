"""End to end: the engine on a tiny DeepSeek-V3 checkpoint with the ascend950 op table, KV layout and attention
(over the fake torch_npu) generates the same greedy tokens as the cpu backend, through chunked prefills,
mixed prefill/decode steps and 128-token blocks allocated by the layout.

These are glue tests on CPU against a fake torch_npu written from its documentation — not evidence that the
backend runs on Ascend hardware. They run in float32, which the backend's Capabilities do not offer (the
documented attention op takes float16/bfloat16 only; the fake relaxes that here on purpose), so that the
comparison with the cpu backend is tight; the sampler, communicator (world size 1) and cost model are the
cpu backend's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fake_torch_npu import FakeTorchNpu

from deepinfer_ascend950.attention import AscendAttention
from deepinfer_ascend950.kv import AscendKVLayout
from deepinfer_ascend950.ops import AscendOps
from deepinfer_core.backend.registry import discover
from deepinfer_core.backend.resolve import ResolvedBackend, resolve_backend
from deepinfer_core.backend.selection import select_backend
from deepinfer_core.engine.llm import LLM
from deepinfer_core.sampling.params import SamplingParams

BLOCK = 128


@pytest.fixture(scope="module")
def cpu_backend() -> ResolvedBackend:
    return resolve_backend(select_backend(discover(), "cpu"), dtype=torch.float32, block_size=BLOCK)


def ascend_on_fake(cpu: ResolvedBackend, npu: FakeTorchNpu) -> ResolvedBackend:
    layout = AscendKVLayout(npu, cpu.torch_device, BLOCK)
    return dataclasses.replace(cpu, ops=AscendOps(npu), kv_layout=layout, attention=AscendAttention(npu, layout))


def _generate(checkpoint, backend: ResolvedBackend, prompts: list[list[int]]):
    llm = LLM(
        model=checkpoint,
        backend=backend,
        block_size=BLOCK,
        num_kv_blocks=12,
        max_num_batched_tokens=96,  # prompts are prefilled in chunks, beside other requests' decodes
        progress=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)
    return [out.outputs[0] for out in llm.generate(prompts, params)]


def test_greedy_tokens_match_the_cpu_backend(tiny_checkpoint, cpu_backend):
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(2, 128, (130,), generator=g).tolist()  # one full block shared by two prompts
    prompts = [
        torch.randint(2, 128, (5,), generator=g).tolist(),
        shared + torch.randint(2, 128, (20,), generator=g).tolist(),  # 150 tokens: two blocks, two chunks
        torch.randint(2, 128, (61,), generator=g).tolist(),
        shared + torch.randint(2, 128, (3,), generator=g).tolist(),
    ]
    npu = FakeTorchNpu(allow_float32_attention=True)
    ascend = ascend_on_fake(cpu_backend, npu)
    got = _generate(tiny_checkpoint, ascend, prompts)
    want = _generate(tiny_checkpoint, cpu_backend, prompts)
    for i, (a, b) in enumerate(zip(got, want)):
        assert len(a.token_ids) == 10
        assert a.token_ids == b.token_ids, f"prompt {i}: {a.token_ids} != {b.token_ids}"
        torch.testing.assert_close(torch.tensor(a.token_logprobs), torch.tensor(b.token_logprobs), rtol=1e-4, atol=1e-4)
    # the ascend950 glue really ran: every torch_npu op the dense path and the MoE layers use
    used = {call.op for call in npu.calls}
    assert used == {
        "npu_rms_norm", "npu_rotary_mul", "npu_swiglu", "npu_moe_gating_top_k", "npu_grouped_matmul",
        "npu_scatter_nd_update_", "npu_fused_infer_attention_score",
    }  # fmt: skip
    chunked = [c for c in npu.calls_of("npu_fused_infer_attention_score") if len(c.args["actual_seq_lengths"]) > 1]
    assert chunked, "no step mixed several sequences"
