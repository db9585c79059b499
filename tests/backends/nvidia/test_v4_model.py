"""A tiny DeepSeek-V4 model runs end to end on the nvidia_sm100 op table (its Triton kernels under the interpreter,
its PyTorch-reference V4 attention) and generates what the cpu reference backend generates.

The engine is the cpu backend's with `ops` and `attention` swapped for NvidiaOps / NvidiaAttention over the
same ReferenceKVLayout (what the nvidia backend builds on a GPU): every V4 op and op feature is called —
hash and sqrtsoftplus routing, the swiglu limit in the shared experts and the grouped expert GEMM, sliding-
window, CSA and HCA attention with the indexer, hyper-connections — in prefill chunks and decode steps.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer_conformance.tiny_v4 import write_tiny_v4
from deepinfer_core.backend.registry import discover
from deepinfer_core.backend.resolve import resolve_backend
from deepinfer_core.backend.selection import select_backend
from deepinfer_core.engine.llm import LLM
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_nvidia_sm100.ops import NvidiaAttention, NvidiaOps

# shorter than the window (8); longer, with one HCA entry (16) and fewer CSA entries (4-6) than the indexer's
# top-k (8); several of each, the indexer choosing 8 of 10-12, an HCA entry completed by a decode step (position
# 47). Each token costs ~1 s under the interpreter: a longer prompt adds no path (a fourth, of 77, doubled the time).
PROMPTS = (3, 17, 41)
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory):
    return write_tiny_v4(tmp_path_factory.mktemp("tiny-v4"))  # the conformance suite's tiny V4


class Recorded:
    """An op table or attention that records which of its methods the model called."""

    def __init__(self, inner, called: set[str]) -> None:
        self._inner, self._called = inner, called

    def __getattr__(self, name: str):
        self._called.add(name)
        return getattr(self._inner, name)


class RecordedLimits(Recorded):
    """Also records the V4 keywords the model passed."""

    def silu_and_mul(self, x, **kwargs):
        self._called.update(f"silu_and_mul:{k}" for k in kwargs)
        return self._inner.silu_and_mul(x, **kwargs)

    def expert_ffn(self, *args, **kwargs):
        self._called.update(f"expert_ffn:{k}" for k in kwargs)
        return self._inner.expert_ffn(*args, **kwargs)

    def moe_route(self, logits, config, bias=None, **kwargs):
        self._called.update([f"moe_route:{config.method}:{config.scoring}", *(f"moe_route:{k}" for k in kwargs)])
        return self._inner.moe_route(logits, config, bias, **kwargs)


def generate(path, backend, prompts=PROMPTS, tokens=NEW_TOKENS) -> list:
    llm = LLM(model=path, backend=backend, num_kv_blocks=80, max_num_seqs=2, max_num_batched_tokens=16, progress=False)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in prompts]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=5)
    return [o.outputs[0] for o in llm.generate(prompts, params)]


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_tiny_v4_generates_as_the_reference(tiny_v4, one_thread):
    cpu = resolve_backend(select_backend(discover(), "cpu"), dtype=torch.float32, block_size=16)
    called: set[str] = set()
    ops, attention = RecordedLimits(NvidiaOps(), called), Recorded(NvidiaAttention(cpu.kv_layout), called)
    got = generate(tiny_v4, dataclasses.replace(cpu, ops=ops, attention=attention))
    want = generate(tiny_v4, cpu)
    v4 = {"hc_pre", "hc_post", "softmax_pool", "sparse_attention", "indexer_topk", "moe_route:expert_ids"}
    v4 |= {"silu_and_mul:limit", "expert_ffn:swiglu_limit", "moe_route:hash:sqrtsoftplus"}
    assert v4 | {"moe_route:greedy:sqrtsoftplus"} <= called, f"not called: {v4 - called}"
    differs = False
    for mine, theirs in zip(got, want):
        assert mine.token_ids == theirs.token_ids
        for ours, ref in zip(mine.top_logprobs, theirs.top_logprobs):
            assert list(ours) == list(ref)
            ours, ref = torch.tensor(list(ours.values())), torch.tensor(list(ref.values()))
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-4)  # a log-softmax over 512 logits
            differs |= not torch.equal(ours, ref)
    assert differs, "bit for bit the reference's logprobs: were the Triton kernels called at all?"


class RecordedFormats(Recorded):
    """Also records the formats of the weights `linear` and `expert_ffn` were given."""

    def linear(self, x, weight, bias=None):
        self._called.add(f"linear:{type(weight).__name__}")
        return self._inner.linear(x, weight, bias)

    def expert_ffn(self, x, counts, w13, w2, **kwargs):
        self._called.add(f"expert_ffn:{type(w13).__name__}")
        return self._inner.expert_ffn(x, counts, w13, w2, **kwargs)


def test_native_v4_checkpoint_runs_its_fp4_and_fp8_weights_through_the_kernels(tmp_path, one_thread):
    """DeepSeek's native layout and formats (model/native_export.py): the nvidia op table, declaring fp8_block and
    mxfp4, gets the routed experts as MXFP4 and the projections as E8M0 FP8 and generates what the cpu reference
    generates from the float twin."""
    from deepinfer_conformance.tiny_v4 import TINY_V4, tiny_v4_weights
    from deepinfer_core.model.native_export import write_float_twin, write_native

    twin = write_float_twin(
        tmp_path / "twin", TINY_V4, write_native(tmp_path / "native", TINY_V4, tiny_v4_weights(), "v4")
    )
    cpu = resolve_backend(select_backend(discover(), "cpu"), dtype=torch.float32, block_size=16)
    called: set[str] = set()
    formats = dataclasses.replace(cpu.capabilities, weight_formats=("fp8_block", "mxfp4"))
    nvidia = dataclasses.replace(cpu, ops=RecordedFormats(NvidiaOps(), called), capabilities=formats,
                                 attention=NvidiaAttention(cpu.kv_layout))  # fmt: skip
    got = generate(tmp_path / "native", nvidia, prompts=(3, 17), tokens=6)
    want = generate(twin, cpu, prompts=(3, 17), tokens=6)
    assert {"expert_ffn:MXFP4", "linear:BlockFP8"} <= called, called
    for mine, theirs in zip(got, want):
        assert mine.token_ids == theirs.token_ids
        for ours, ref in zip(mine.top_logprobs, theirs.top_logprobs):
            assert list(ours) == list(ref)
            torch.testing.assert_close(torch.tensor(list(ours.values())), torch.tensor(list(ref.values())),
                                       rtol=1e-5, atol=1e-4)  # fmt: skip
