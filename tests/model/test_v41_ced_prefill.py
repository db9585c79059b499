"""DeepSeek-V4.1's "CED prefill" (deepinfer_core/model/v41_skip.py): with `needed_from` each layer processes
only the tokens a needed position depends on, and what is needed comes out as if every token had been run.

On tiny random checkpoints (tests/model/v41_checkpoints.py) over caches full of garbage, so a read of an entry
a skipped token should have written shows. Narrowed and full runs add up floats over different row counts,
so they are compared to float32 noise, not bitwise. The rows each layer processed are counted with a stand-in
for its attention and checked against the rule, restated here in closed form.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer_core.backend.registry import discover
from deepinfer_core.backend.resolve import resolve_backend
from deepinfer_core.backend.selection import select_backend
from deepinfer_core.kv.layout import ring_slots
from deepinfer_core.model import load_model, model_registry
from deepinfer_core.model.v4_step import V4Step
from deepinfer_core.sampling.params import SamplingParams
from tests.model.step_runner import garbage_runner, shuffled_requests, step_logits
from tests.model.v41_checkpoints import write_checkpoint

BLOCK, NUM_BLOCKS, SEQ_SLOTS = 16, 96, 8
DECODE = 4  # greedy tokens after each prefill
TOL = dict(rtol=1e-5, atol=1e-5)
CONFIGS = {
    # the released shape: sliding layers, a ratio-2 group, then ratio-1 decoder layers; an index source and an
    # engram layer past the last KV source
    "decoder_tail": {
        "num_hidden_layers": 8,
        "compress_ratios": [0, 2, 2, 2, 1, 1, 1, 1],
        "kv_source_layer_ids": [1, 4],
        "index_source_layer_ids": [1, 4, 6],
        "candidate_source_layer_id": 4,
        "engram_layer_ids": [0, 6],
    },
    "ratio_four": {
        "num_hidden_layers": 6,
        "compress_ratios": [0, 4, 4, 1, 1, 1],
        "kv_source_layer_ids": [1, 3],
        "index_source_layer_ids": [1, 3],
        "candidate_source_layer_id": -1,
        "engram_layer_ids": [2],
        "hc_mult": 2,
        "sliding_window": 5,
    },
    # the only KV source first: its top-k and candidate blocks are reused by narrowed layers
    "sliding_after_source": {
        "num_hidden_layers": 5,
        "compress_ratios": [1, 1, 1, 0, 0],
        "kv_source_layer_ids": [0],
        "index_source_layer_ids": [0, 2],
        "candidate_source_layer_id": 0,
        "engram_layer_ids": [4],
        "sliding_window": 4,
    },
    "no_kv_source": {
        "num_hidden_layers": 4,
        "compress_ratios": [0, 0, 0, 0],
        "engram_layer_ids": [1],
        "sliding_window": 7,
    },
    # a compress ratio wider than the window
    "ratio_past_window": {
        "num_hidden_layers": 4,
        "compress_ratios": [0, 4, 4, 4],
        "kv_source_layer_ids": [1],
        "index_source_layer_ids": [1],
        "candidate_source_layer_id": -1,
        "engram_layer_ids": [],
        "sliding_window": 3,
    },
}
CASES = sorted(CONFIGS)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py


@pytest.fixture(scope="module")
def backend():
    return resolve_backend(select_backend(discover(), "cpu"), dtype=torch.float32, block_size=BLOCK)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("v41-ced")
    return {name: write_checkpoint(root / name, CONFIGS[name], seed=i) for i, name in enumerate(CASES)}


class _RowCounter:
    """Stands in for one layer's attention: counts the token rows it is called with."""

    def __init__(self, attention) -> None:
        self.attention, self.rows = attention, 0

    def __getattr__(self, name: str):
        return getattr(self.attention, name)

    def __call__(self, x: torch.Tensor, *args):
        self.rows += x.shape[0]
        return self.attention(x, *args)


class _Run:
    """A model with row counters, its runner over garbage caches, and requests on shuffled blocks and slots
    (the same for the same prompts and seed)."""

    def __init__(self, folder: Path, backend, prompts, *, seed: int = 5, placement: str = "auto") -> None:
        self.model = load_model(folder, backend, model_registry(engram_placement=placement), progress=False)
        self.counters = []
        for i, (mixers, norms, attention, moe, engram) in enumerate(self.model.layers):
            self.counters.append(_RowCounter(attention))
            self.model.layers[i] = (mixers, norms, self.counters[-1], moe, engram)
        self.runner = garbage_runner(self.model, backend, num_blocks=NUM_BLOCKS, seq_slots=SEQ_SLOTS)
        self.requests = shuffled_requests(
            prompts, seed, num_blocks=NUM_BLOCKS, seq_slots=SEQ_SLOTS, block=BLOCK, spare_tokens=DECODE
        )

    def step(self, scheduled, *, skip: bool) -> tuple[list[torch.Tensor], list[int]]:
        """Per request its logits, and per layer the rows it processed."""
        for counter in self.counters:
            counter.rows = 0
        logits = step_logits(self.model, self.runner, scheduled, every_row=not skip)
        return logits, [counter.rows for counter in self.counters]

    def greedy(self, last_logits: list[torch.Tensor], *, skip: bool) -> list[torch.Tensor]:
        """DECODE greedy steps of every request from their last logits [V]; the logits [R, V] of each."""
        out = []
        for _ in range(DECODE):
            for request, logits in zip(self.requests, last_logits):
                request.output_token_ids.append(int(logits.argmax()))
            last_logits = [rows[-1] for rows in self.step([(r, 1) for r in self.requests], skip=skip)[0]]
            out.append(torch.stack(last_logits))
        return out

    def ring(self, layer: int, request, positions: range) -> torch.Tensor:
        """Layer `layer`'s window entries of `positions` of `request`."""
        spec = self.model.cache_specs[layer]["window"]
        slots = ring_slots(request.seq_slot, torch.tensor(list(positions)), spec.ring_size)
        return self.model.backend.kv_layout.gather(self.runner.caches[layer]["window"], spec, slots)


def _first_processed(cfg, layer: int, needed: int, cached: int) -> int:
    """The rule in closed form: the needed position's windows walked down one layer at a time, and every KV
    source at or above `layer` writing each entry from `cached` on, walked down likewise."""
    reach = cfg.sliding_window - 1
    walks = [needed - reach * (cfg.num_hidden_layers - layer)]
    walks += [cached - reach * (source - layer) for source in cfg.kv_source_layer_ids if source >= layer]
    return min(walks)


def _expected_rows(cfg, spans) -> list[int]:
    """Per layer, the rows a step of `spans` [(first position, end position, needed_from, cached_lens)] has."""
    return [
        sum(
            max(0, end - max(first, _first_processed(cfg, layer, needed, cached)))
            for first, end, needed, cached in spans
        )
        for layer in range(cfg.num_hidden_layers)
    ]


def _prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 330, (n,), generator=g).tolist() for n in lengths]


def _assert_same_decode(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for mine, theirs in zip(got, want):
        assert torch.equal(mine.argmax(-1), theirs.argmax(-1))
        torch.testing.assert_close(mine, theirs, **TOL)


@pytest.mark.parametrize("case", CASES)
def test_a_ragged_prefill_gives_the_last_logits_continuation_and_windows_of_a_full_one(
    case, checkpoints, backend, monkeypatch
):
    prompts = _prompts(1, [200, 9, 131])
    placement = "host" if case == "decoder_tail" else "auto"  # engram rows gathered on the host, then narrowed
    narrow, full = (_Run(checkpoints[case], backend, prompts, placement=placement) for _ in range(2))
    scheduled = [(r, len(r.prompt_token_ids)) for r in narrow.requests]
    got, rows = narrow.step(scheduled, skip=True)
    want, full_rows = full.step([(r, len(r.prompt_token_ids)) for r in full.requests], skip=False)
    cfg = narrow.model.config
    assert rows == _expected_rows(cfg, [(0, len(p), len(p) - 1, 0) for p in prompts])
    assert full_rows == [sum(map(len, prompts))] * cfg.num_hidden_layers
    assert rows[-1] < rows[0]  # it did skip
    for mine, theirs in zip(got, want):
        torch.testing.assert_close(mine[-1], theirs[-1], **TOL)

    window = cfg.sliding_window
    for layer, (mine, theirs) in enumerate(zip(narrow.runner.caches, full.runner.caches)):
        for request, prompt in zip(narrow.requests, prompts):  # the last `window` positions of every ring
            last = range(max(0, len(prompt) - window), len(prompt))
            torch.testing.assert_close(narrow.ring(layer, request, last), full.ring(layer, request, last), **TOL)
        for name in mine.keys() - {"window"}:  # compressed entries, index keys, partial groups, n-gram history
            torch.testing.assert_close(
                mine[name], theirs[name], **TOL, msg=lambda m, at=f"layer {layer} {name}": f"{at}: {m}"
            )

    monkeypatch.setattr(V4Step, "suffix", lambda *a: pytest.fail("a decode step has nothing to narrow"))
    decoded = narrow.greedy([r[-1] for r in got], skip=True)
    _assert_same_decode(decoded, full.greedy([r[-1] for r in want], skip=False))


@pytest.mark.parametrize("case", ["decoder_tail", "no_kv_source"])
def test_chunks_no_needed_position_reaches_skip_the_late_layers_and_the_result_stays(case, checkpoints, backend):
    long, short = _prompts(2, [220, 30])
    narrow = _Run(checkpoints[case], backend, [long, short])
    a, b = narrow.requests
    cfg = narrow.model.config
    _, rows = narrow.step([(a, 70)], skip=True)
    assert rows == _expected_rows(cfg, [(0, 70, 219, 0)])
    assert rows[-1] == 0  # no needed window reaches the first chunk there
    logits, rows = narrow.step([(a, 90), (b, 30)], skip=True)  # a's middle chunk beside b's whole prompt
    assert rows == _expected_rows(cfg, [(70, 160, 219, 0), (0, 30, 29, 0)])
    assert rows[-1] == cfg.sliding_window  # b's last window: a's chunk dropped out of the step
    last_b = logits[1][-1]
    logits, rows = narrow.step([(a, 60)], skip=True)
    assert rows == _expected_rows(cfg, [(160, 220, 219, 0)])
    got = [logits[0][-1], last_b]

    full = _Run(checkpoints[case], backend, [long, short])
    want, _ = full.step([(r, len(r.prompt_token_ids)) for r in full.requests], skip=False)
    for mine, theirs in zip(got, want):
        torch.testing.assert_close(mine, theirs[-1], **TOL)
    _assert_same_decode(narrow.greedy(got, skip=True), full.greedy([r[-1] for r in want], skip=False))


@pytest.mark.parametrize("tail", [1, 20])
@pytest.mark.parametrize("case", ["decoder_tail", "ratio_past_window", "sliding_after_source"])
def test_a_prefix_hits_exact_replay_skips_too_and_matches_a_full_run(case, tail, checkpoints, backend):
    hit = 192  # 12 full blocks shared
    first, extra = _prompts(3, [200, tail])
    second = first[:hit] + extra
    narrow = _Run(checkpoints[case], backend, [first, second])
    a, b = narrow.requests
    narrow.step([(a, len(first))], skip=True)  # a's blocks now hold the shared prefix's compressed KV
    b.block_ids[: hit // BLOCK] = a.block_ids[: hit // BLOCK]  # what the block manager gives a hit
    b.num_cached_tokens = hit
    b.num_computed_tokens = b.window_start = start = max(0, hit - narrow.model.replay_tokens)
    logits, rows = narrow.step([(b, len(second) - start)], skip=True)
    assert rows == _expected_rows(narrow.model.config, [(start, len(second), len(second) - 1, hit)])
    assert rows[-1] < len(second) - start

    full = _Run(checkpoints[case], backend, [second])
    want, _ = full.step([(full.requests[0], len(second))], skip=False)
    torch.testing.assert_close(logits[0][-1], want[0][-1], **TOL)
    narrow.requests = [b]
    _assert_same_decode(narrow.greedy([logits[0][-1]], skip=True), full.greedy([want[0][-1]], skip=False))


def test_prompt_logprobs_need_every_row(checkpoints, backend):
    prompts = _prompts(4, [120, 40])
    narrow, full = (_Run(checkpoints["decoder_tail"], backend, prompts) for _ in range(2))
    narrow.requests[0].params = SamplingParams(prompt_logprobs=1)
    got, rows = narrow.step([(r, len(r.prompt_token_ids)) for r in narrow.requests], skip=True)
    cfg = narrow.model.config
    assert rows == _expected_rows(cfg, [(0, 120, 0, 0), (0, 40, 39, 0)])
    assert rows[-1] == 120 + cfg.sliding_window
    want, _ = full.step([(r, len(r.prompt_token_ids)) for r in full.requests], skip=False)
    torch.testing.assert_close(got[0], want[0], **TOL)  # every position's logits
