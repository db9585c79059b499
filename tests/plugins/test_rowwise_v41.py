"""The example backend plugins/rowwise_cpu on DeepSeek-V4.1: it declares every op of V41_OPS, the new ops keep
its bitwise batch invariance, and the reference-recorded checkpoints of tests/fixtures/deepseek_v41 give the
reference's prefill logits on it. The ops themselves are checked against the reference backend by the
conformance suite's v41_ops / v41_attention cases (`deepinfer conformance --backend rowwise_cpu`).

Like test_rowwise_v4.py, the distribution is used as installed here; where it is not, the session installs
it with pip into a temporary directory put on sys.path. The fixture loading, step and comparison helpers are
tests/model/test_deepseek_v41_parity.py's, loaded from there.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from deepinfer_core.backend.ops import BLOCK_FORMATS, V41_OPS, AttentionMetadata
from deepinfer_core.backend.registry import discover
from deepinfer_core.backend.resolve import resolve_backend
from deepinfer_core.backend.selection import select_backend

BLOCK = 16


def _load(name: str, path: Path):
    """The test module at `path` as module `name`, loaded once per process (tests are not a package)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


TESTS = Path(__file__).parents[1]
PARITY = _load("deepinfer_tests_v41_parity", TESTS / "model" / "test_deepseek_v41_parity.py")
V4 = _load("deepinfer_tests_rowwise_v4", TESTS / "plugins" / "test_rowwise_v4.py")  # its V4 cache batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py


@pytest.fixture(scope="session")
def rw(install_distributions):
    """The rowwise_cpu backend as the engine builds it (float32, block size 16), through its hooks."""
    try:
        importlib.metadata.distribution("deepinfer-rowwise-cpu")
    except importlib.metadata.PackageNotFoundError:
        sys.path.insert(0, str(install_distributions("rowwise_cpu")))
        importlib.invalidate_caches()
    return resolve_backend(select_backend(discover(), "rowwise_cpu"), dtype=torch.float32, block_size=BLOCK)


def test_declares_every_v41_op(rw):
    assert all(rw.capabilities.supports(op) is True for op in V41_OPS)


# ------------------------------------------------------------------------------ batch invariance (bitwise)


def test_v41_rows_do_not_depend_on_the_batch(rw):
    ops, rows, randn = rw.ops, [0, 1, 17, 36], V4._randn
    streams = randn(37, 3, 32, seed=1, dtype=torch.bfloat16, scale=2.0)
    block_out, key = randn(37, 32, seed=2, dtype=torch.bfloat16), randn(37, 3, 32, seed=3)
    fn, scale, base = V4._hc_args(3, 32, True, seed=4)
    hc = dict(sinkhorn_iters=3, eps=1e-6, norm_eps=1e-20)
    pre, post, comb = ops.hc_mixes(streams, fn, scale, base, **hc)
    weight, dead = 0.5 + randn(3, 32, seed=5).abs(), torch.arange(37) % 5 == 0
    w13, w2 = randn(1, 48, 32, seed=6, dtype=torch.bfloat16), randn(1, 32, 24, seed=7, dtype=torch.bfloat16)
    routing_weights = randn(37, seed=8).abs()  # expert_ffn's row_scales
    batched = {
        "hc_mixes": lambda s: torch.cat([t.flatten(1) for t in ops.hc_mixes(streams[s], fn, scale, base, **hc)], 1),
        "hc_collapse": lambda s: ops.hc_collapse(streams[s], pre[s]),
        "hc_expand": lambda s: ops.hc_expand(block_out[s], streams[s], post[s], comb[s]),
        "engram_gate": lambda s: ops.engram_gate(streams[s], key[s], block_out[s], weight, dead[s], eps=1e-20),
        **{fmt: (lambda s, fmt=fmt: ops.round_to_format(streams[s], fmt)) for fmt in BLOCK_FORMATS},
        "expert_row_scales": lambda s: ops.expert_ffn(
            block_out[s], torch.tensor([block_out[s].shape[0]]), w13, w2, row_scales=routing_weights[s]
        ),
    }
    for name, op in batched.items():
        full = op(slice(None))
        for r in rows:
            assert torch.equal(op(slice(r, r + 1))[0], full[r]), (name, r)
        assert torch.equal(op(slice(10, 20)), full[10:20]), name
    # hc_collapse is hc_pre's collapse, bitwise, for the same pre
    assert torch.equal(ops.hc_collapse(streams, pre), ops.hc_pre(streams, fn, scale, base, **hc)[0])


def test_indexer_select_row_is_the_same_alone_as_in_the_ragged_batch(rw):
    (_, comps), _, spec, meta, kv = V4._v4_batch([rw.kv_layout], torch.float32, rate=2, dim=8, seed=4)
    tokens = kv.shape[0]
    q, weights = V4._randn(tokens, 3, 8, seed=5), V4._randn(tokens, 3, seed=6)
    q[::3] = 0.0  # rows whose scores are all exact-zero ties
    within = torch.randint(-1, 8, (tokens, 3), generator=torch.Generator().manual_seed(7))
    kwargs = dict(top_k=5, scale=8**-0.5, block_size=4)
    for use in (dict(top_blocks=3), dict(within=within)):
        full = rw.attention.indexer_select(q, weights, comps[0], spec, meta, **kwargs, **use)
        starts = meta.query_start_loc.tolist()
        for b, (seq_len, q_len, _) in enumerate(V4.SEQS):
            for i in range(q_len):  # the same query as the last of a step that starts at the same first token
                t = starts[b] + i
                alone = AttentionMetadata(
                    torch.tensor([0, i + 1]),
                    torch.tensor([seq_len - q_len + i + 1]),
                    meta.block_tables[b : b + 1],
                    meta.slot_mapping[: i + 1],
                    seq_slots=meta.seq_slots[b : b + 1],
                    window_starts=meta.window_starts[b : b + 1],
                    cached_lens=meta.cached_lens[b : b + 1],
                )
                rows = slice(starts[b], t + 1)
                one = {k: v[rows] if isinstance(v, torch.Tensor) else v for k, v in use.items()}
                got = rw.attention.indexer_select(q[rows], weights[rows], comps[0], spec, alone, **kwargs, **one)
                for mine, theirs in zip(got, full):
                    assert (mine is None and theirs is None) or torch.equal(mine[-1], theirs[t]), (use.keys(), t)


# ------------------------------------------------------------------------------ the reference's recordings


@pytest.mark.parametrize("case", PARITY.CASES)
def test_v41_fixture_prefill_matches_the_reference(rw, case):
    """Ragged prefill of every prompt of the case in one forward on rowwise_cpu (float32), against the
    reference's `prefill.{i}` logits, by the parity test's rule (tight, bar one run of FP8/FP4 rounding flips)."""
    meta, want = PARITY._case(case)
    model = PARITY._model(case, rw)
    requests = PARITY._requests(meta["prefill"]["prompts"], seed=5)
    scheduled = [(r, len(r.prompt_token_ids)) for r in requests]
    got = PARITY._step_logits(model, PARITY._runner(model, rw), scheduled)
    for i, name in enumerate(meta["prefill"]["logits"]):
        PARITY._assert_matches(got[i], want[name], model.config.sliding_window, f"{case} prompt {i} on rowwise_cpu")
