"""Decode steps replayed through `DecodeGraphs` give what eager steps give: padding rows write and read only
the scratch block, static inputs are refreshed every step, and graphs are captured once per padded size.

The capture here is a stand-in that replays by calling the step again over the same static tensors, which
is what a device graph does; rowwise_cpu is batch-invariant, so padding must not change a single bit."""

from __future__ import annotations

import dataclasses
import functools
import weakref

import pytest
import torch

from deepinfer_core.backend.registry import discover
from deepinfer_core.backend.resolve import resolve_backend
from deepinfer_core.backend.selection import select_backend
from deepinfer_core.engine.graphs import DecodeGraphs, capture_sizes
from deepinfer_core.engine.llm import LLM
from deepinfer_core.kv.layout import ring_slots
from deepinfer_core.sampling.params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py


class ReplayByCalling:
    """A GraphCapture whose 'graph' is the step itself; counts captures and replays. Like a real capture it
    runs the step before capturing (CUDA graphs: warm-up runs), so a step must give the same result when run
    again on the caches it wrote. Like a real graph it does not keep the step alive: a graph replays device work
    over the tensors the step read, so their owner must hold them (and here, the step)."""

    WARMUP_RUNS = 2

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0

    def capture(self, step):
        self.captures += 1
        for _ in range(self.WARMUP_RUNS):
            step()
        captured = weakref.ref(step)
        del step

        def replay():
            self.replays += 1
            step = captured()
            assert step is not None, "the captured step was freed: a device graph would read freed memory"
            return step()

        return replay


@functools.cache
def _eager(run, checkpoint) -> list:
    """The eager steps' results of `run` (_run or _run_v4): the same for every test, computed once."""
    return run(checkpoint, None, 0)[0]


def _run(checkpoint, graphs, graph_batch_size: int):
    backend = resolve_backend(select_backend(discover(), "rowwise_cpu"), dtype=torch.float32, block_size=16)
    backend = dataclasses.replace(backend, graphs=graphs)
    llm = LLM(model=checkpoint, backend=backend, num_kv_blocks=40, graph_batch_size=graph_batch_size, progress=False)
    prompts = [torch.randint(2, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17, 9)]
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5),
        SamplingParams(temperature=0.8, seed=3, max_tokens=7, ignore_eos=True, logprobs=5),  # leaves early
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=5),
    ]
    outputs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, o.outputs[0].token_logprobs, o.outputs[0].top_logprobs) for o in outputs], llm


def test_capture_sizes_cover_every_batch():
    sizes = capture_sizes(40)
    assert sizes[0] == 1 and sizes[-1] == 40
    assert all(any(s >= b for s in sizes) for b in range(1, 41))


@pytest.mark.parametrize("graph_batch_size", [8, 2])  # 2: the 3-sequence steps run eagerly, the rest replay
def test_replayed_decode_steps_match_eager_bit_for_bit(tiny_checkpoint, graph_batch_size):
    eager = _eager(_run, tiny_checkpoint)
    capture = ReplayByCalling()
    replayed, llm = _run(tiny_checkpoint, capture, graph_batch_size)
    assert capture.replays > 10, "decode steps did not go through the graphs"
    graphs = llm.engine.runner.graphs
    assert capture.captures == len(graphs._replays)  # one per padded size and width used
    assert replayed == eager
    # every graph copies its logits into one buffer: none keeps its own past its capture
    with torch.inference_mode():
        outputs = {step().data_ptr() for step in graphs._steps.values()}
    assert outputs == {graphs._logits.data_ptr()} and len(graphs._steps) > 1


def test_padding_rows_write_the_scratch_block(tiny_checkpoint):
    """Three sequences pad to 4 rows: the padding row writes the scratch block past the handed-out ones."""
    capture = ReplayByCalling()
    _, llm = _run(tiny_checkpoint, capture, 8)
    runner, layout = llm.engine.runner, llm.backend.kv_layout
    scratch_slot = torch.tensor([llm.engine.blocks.num_blocks * runner.block_size])  # first slot of the scratch block
    written = [layout.gather(cache["kv"], llm.model.cache_spec, scratch_slot) for cache in runner.caches]
    assert all(bool(entry.abs().sum() > 0) for entry in written), "padding rows did not write the scratch block"


def _run_v4(checkpoint, graphs, graph_batch_size: int):
    backend = resolve_backend(select_backend(discover(), "rowwise_cpu"), dtype=torch.float32, block_size=16)
    backend = dataclasses.replace(backend, graphs=graphs)
    llm = LLM(model=checkpoint, backend=backend, num_kv_blocks=40, graph_batch_size=graph_batch_size, progress=False)
    prompts = [torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 30, 9)]
    params = [  # 30 + 20 tokens: windows of rates 4 and 8 finish during decode, every ring wraps
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=5),
        SamplingParams(temperature=0.8, seed=3, max_tokens=7, ignore_eos=True, logprobs=5),  # leaves early
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=5),
    ]
    outputs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, o.outputs[0].token_logprobs, o.outputs[0].top_logprobs) for o in outputs], llm


def test_deepseek_v4_decode_steps_replay_with_padded_sequence_slots(hf_v4_checkpoint):
    """V4's per-sequence caches: padding rows use the scratch sequence slot, and a decode step planned on the
    device (unfinished windows' provisional entries included) gives the eager steps' tokens and logprobs."""
    checkpoint = hf_v4_checkpoint("a").path
    eager = _eager(_run_v4, checkpoint)
    capture = ReplayByCalling()
    replayed, llm = _run_v4(checkpoint, capture, 8)
    assert capture.replays > 10, "decode steps did not go through the graphs"
    assert replayed == eager
    runner, spec = llm.engine.runner, llm.model.layers[0][2].window_spec
    scratch = runner.graphs._scratch_seq_slot  # past the scheduler's slots, which the eager run also had
    assert scratch == llm.engine.blocks.num_seq_slots
    entries = llm.backend.kv_layout.gather(
        runner.caches[0]["window"], spec, ring_slots(scratch, torch.arange(spec.ring_size), spec.ring_size)
    )
    assert bool(entries.abs().sum() > 0), "padding rows did not write the scratch sequence slot"


def test_graphs_follow_the_block_table_width_in_buckets(hf_v4_checkpoint, monkeypatch):
    """With buckets from one block, decode steps whose widest sequence spans 2 to 4 blocks of 16 replay graphs of
    widths 2 and 4 (each captured once per padded size; the V4 indexer's entry slots sized by them) and give the
    eager results; a width of 3 blocks runs on the graphs of 4, its last column -1."""
    monkeypatch.setattr(DecodeGraphs, "MIN_WIDTH", 1)
    checkpoint = hf_v4_checkpoint("a").path
    eager = _eager(_run_v4, checkpoint)
    capture = ReplayByCalling()
    replayed, llm = _run_v4(checkpoint, capture, 8)
    assert replayed == eager
    graphs = llm.engine.runner.graphs
    assert {width for _, _, width in graphs._replays} == {2, 4}
    assert capture.captures == len(graphs._replays)
    assert [graphs.width_bucket(w) for w in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, 128]
    assert graphs.width_bucket(graphs.max_blocks_per_seq) == graphs.max_blocks_per_seq
