"""The example third-party backend plugins/rowwise_cpu, installed for real: discovery and selection, every op,
KV layout, attention and sampler against the reference backend, bitwise batch invariance, and generation.

The distribution is used as installed in this environment (`pip install -e plugins/rowwise_cpu`); where it
is not, the session installs it with pip into a temporary directory put on sys.path, like a user would.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepinfer_core.backend.ops import AttentionMetadata, RoutingConfig
from deepinfer_core.backend.registry import discover
from deepinfer_core.backend.resolve import resolve_backend
from deepinfer_core.backend.selection import select_backend
from deepinfer_core.engine.cost import CostModel
from deepinfer_core.kv.layout import CacheKind, CacheSpec, paged_slots, ring_slots
from deepinfer_core.reference.attention import ReferenceAttention
from deepinfer_core.reference.kv import ReferenceKVLayout
from deepinfer_core.reference.ops import ReferenceOps
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.sampling.sampler import SamplingBatch, TorchSampler

PLUGIN = Path(__file__).parents[2] / "plugins" / "rowwise_cpu"
DIST = "deepinfer-rowwise-cpu"
REF = ReferenceOps()
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="session")
def rowwise_site(tmp_path_factory):
    """None when the distribution is installed here; else a directory pip installed it into (on sys.path)."""
    try:
        importlib.metadata.distribution(DIST)
        return None
    except importlib.metadata.PackageNotFoundError:
        pass
    root = tmp_path_factory.mktemp("rowwise-site")
    source = shutil.copytree(PLUGIN, root / "src", ignore=shutil.ignore_patterns("*.egg-info", "build"))
    target = root / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run([*pip, "--target", str(target), str(source)], check=True, capture_output=True, text=True)
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    return target


@pytest.fixture(scope="session")
def entry(rowwise_site):
    return select_backend(discover(), "rowwise_cpu")


@pytest.fixture(scope="session")
def rw(entry):
    """The rowwise_cpu backend as the engine builds it (float32, block size 16), through its hooks."""
    return resolve_backend(entry, dtype=torch.float32, block_size=16)


def _randn(*shape, seed=0, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


# ------------------------------------------------------------------------------ discovery and selection


def test_discovered_available_below_cpu_and_selected_by_name(entry, rowwise_site, monkeypatch, run_cli):
    discovery = discover()
    assert entry.available and entry.info.priority == -10 and entry.origin.distribution == DIST
    caps = entry.capabilities
    assert caps.batch_invariant and caps.deterministic_sampling and caps.block_sizes[0] == 64
    assert set(caps.cache_kinds) == set(CacheKind) and isinstance(caps.supports("graph_capture"), str)
    assert not [p for p in discovery.broken if p.origin.name == "rowwise_cpu"]
    monkeypatch.delenv("DEEPINFER_ACCELERATOR", raising=False)
    assert select_backend(discovery, "auto").name == "cpu"
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "rowwise_cpu")
    assert select_backend(discovery).name == "rowwise_cpu"
    result = run_cli(["backends", "--select"], site=rowwise_site, env={"DEEPINFER_ACCELERATOR": "rowwise_cpu"})
    assert result.returncode == 0 and result.stdout.startswith("rowwise_cpu"), result.stderr


def test_hooks_build_its_own_objects(entry, rw):
    assert type(rw.ops).__module__ == "deepinfer_rowwise_cpu.kernels"
    assert type(rw.sampler).__module__ == "deepinfer_rowwise_cpu.sampler"
    assert rw.kv_layout.block_size == 16 and resolve_backend(entry).kv_layout.block_size == 64
    assert rw.device.total_memory_bytes > 0 and rw.device.torch_device == "cpu"
    assert isinstance(rw.cost_model, CostModel)
    costs = [rw.cost_model.cost(q, 100 + q) for q in range(1, 200)]
    assert costs == sorted(costs) and rw.cost_model.cost(64, 64) > rw.cost_model.cost(1, 64)


def test_plugin_imports_only_torch_and_the_public_contract(rowwise_site):
    allowed = (
        "torch",
        "__future__",
        "dataclasses",
        "deepinfer_rowwise_cpu",
        "deepinfer_core.backend",
        "deepinfer_core.kv.layout",
        "deepinfer_core.sampling",
        "deepinfer_core.engine.cost",
    )
    package = Path(importlib.import_module("deepinfer_rowwise_cpu").__file__).parent
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert name.startswith(allowed) and "reference" not in name, (path.name, name)


# ------------------------------------------------------------------------------ ops against the reference


def _routing_cases():
    return {
        "greedy-softmax": (RoutingConfig(8, 2), None),
        "greedy-sigmoid-norm": (RoutingConfig(8, 3, scoring="sigmoid", normalize=True), None),
        "group-limited": (RoutingConfig(16, 3, "group_limited_greedy", num_groups=4, topk_groups=2), None),
        "noaux-tc": (
            RoutingConfig(16, 4, "noaux_tc", "sigmoid", 4, 2, normalize=True, routed_scaling_factor=2.5),
            _randn(16, seed=5, scale=0.5),
        ),
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dense_ops_match_reference(rw, dtype):
    ops = rw.ops
    x, w, b = _randn(7, 40, dtype=dtype), _randn(24, 40, seed=1, dtype=dtype), _randn(24, seed=2, dtype=dtype)
    checks = {
        "rms_norm": (ops.rms_norm(x, w[0], 1e-6), REF.rms_norm(x, w[0], 1e-6)),
        "linear": (ops.linear(x, w), REF.linear(x, w)),
        "linear+bias": (ops.linear(x, w, b), REF.linear(x, w, b)),
        "silu_and_mul": (ops.silu_and_mul(x), REF.silu_and_mul(x)),
    }
    xh, wh = _randn(7, 3, 16, seed=3, dtype=dtype), _randn(3, 8, 16, seed=4, dtype=dtype)
    checks["head_linear"] = (ops.head_linear(xh, wh), REF.head_linear(xh, wh))
    angles = torch.arange(64.0)[:, None] * 0.37 ** torch.arange(4.0)  # [max_pos, R/2]
    positions = torch.tensor([0, 5, 63, 5, 17, 1, 40])
    for interleaved in (True, False):
        args = (_randn(7, 3, 8, seed=6, dtype=dtype), positions, angles.cos(), angles.sin())
        checks[f"rotary-{interleaved}"] = (
            ops.rotary(*args, interleaved=interleaved),
            REF.rotary(*args, interleaved=interleaved),
        )
    for name, (got, want) in checks.items():
        assert got.dtype == want.dtype and got.shape == want.shape, name
        torch.testing.assert_close(got, want, msg=name)


@pytest.mark.parametrize("case", _routing_cases().values(), ids=_routing_cases().keys())
def test_moe_route_matches_reference(rw, case):
    config, bias = case
    logits = _randn(9, config.num_experts, seed=7, scale=2.0)
    weights, ids = rw.ops.moe_route(logits, config, bias)
    ref_weights, ref_ids = REF.moe_route(logits, config, bias)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_expert_ffn_matches_reference(rw, dtype):
    counts = torch.tensor([3, 0, 2, 4])
    x = _randn(9, 16, dtype=dtype)
    w13, w2 = _randn(4, 16, 16, seed=1, dtype=dtype, scale=0.3), _randn(4, 16, 8, seed=2, dtype=dtype, scale=0.3)
    got, want = rw.ops.expert_ffn(x, counts, w13, w2), REF.expert_ffn(x, counts, w13, w2)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want)
    ops, rows = rw.ops, x[3:5]  # expert 2's rows are exactly the dense MLP path of the same op table
    assert torch.equal(got[3:5], ops.linear(ops.silu_and_mul(ops.linear(rows, w13[2])), w2[2]))


# ------------------------------------------------------------------------------ KV layout


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kv_layouts_round_trip_and_gather_like_the_reference(rw, dtype):
    layout, ref = rw.kv_layout, ReferenceKVLayout(torch.device("cpu"), block_size=16)
    paged = CacheSpec(CacheKind.PAGED, dtype, num_heads=2, head_dim=5)
    ring = CacheSpec(CacheKind.SLIDING_WINDOW, dtype, num_heads=3, head_dim=4, window=6, rollback_slots=2)
    state = CacheSpec(CacheKind.SEQUENCE_STATE, dtype, state_shape=(3, 5))
    writes = {
        paged: (6, [paged_slots(torch.tensor([4, 1, 5]), torch.arange(40), 16)], (6, 2, 16, 5)),
        ring: (3, [ring_slots(1, torch.arange(p, p + 4), 8) for p in range(0, 16, 4)], (3, 3, 8, 4)),
        state: (4, [torch.tensor([2, 0]), torch.tensor([2])], (4, 3, 5)),
    }
    for spec, (units, slot_batches, physical) in writes.items():
        mine, theirs = layout.allocate(spec, units), ref.allocate(spec, units)
        assert mine.shape == physical and mine.dtype == dtype and not mine.any()
        for i, slots in enumerate(slot_batches):
            values = _randn(len(slots), *spec.entry_shape, seed=i)
            layout.write(mine, spec, slots, values)
            ref.write(theirs, spec, slots, values)
            torch.testing.assert_close(layout.gather(mine, spec, slots), values.to(dtype))
        every = torch.arange(theirs.shape[0])  # canonical view of every slot, in a shuffled order
        every = every[torch.randperm(len(every), generator=torch.Generator().manual_seed(0))]
        assert torch.equal(layout.gather(mine, spec, every), ref.gather(theirs, spec, every))
    slot = 1 * 16 + 3  # paged: head-major within a block
    cache = layout.allocate(paged, 2)
    layout.write(cache, paged, torch.tensor([slot]), torch.arange(10.0).view(1, 2, 5))
    assert torch.equal(cache[1, :, 3], torch.arange(10.0).view(2, 5).to(dtype))


# ------------------------------------------------------------------------------ paged attention

SEQS = [(27, 27), (50, 6), (20, 0), (33, 1), (17, 3)]  # (seq_len, q_len): prefill, chunk, empty, decodes
ATTENTION = {
    "mla": dict(heads=4, kv_heads=1, key_dim=12, entry_dim=12, value_dim=8, value_offset=0),
    "gqa": dict(heads=6, kv_heads=2, key_dim=8, entry_dim=14, value_dim=6, value_offset=8),
}


def _paged_batch(layouts, case, dtype, block=16):
    """The same random context for SEQS in shuffled blocks of every layout in `layouts`; (caches, spec, meta)."""
    spec = CacheSpec(CacheKind.PAGED, dtype, num_heads=case["kv_heads"], head_dim=case["entry_dim"])
    g = torch.Generator().manual_seed(1)
    free = torch.randperm(20, generator=g).tolist()
    caches = [layout.allocate(spec, 20) for layout in layouts]
    garbage = 50 * torch.randn(20 * block, case["kv_heads"], case["entry_dim"], generator=g)
    for layout, cache in zip(layouts, caches):
        layout.write(cache, spec, torch.arange(20 * block), garbage)  # a wrong read must show up
    tables, slot_mapping = [], []
    for seq_len, q_len in SEQS:
        table = [free.pop() for _ in range(-(-seq_len // block))]
        tables.append(table + [-1] * (4 - len(table)))
        slots = paged_slots(torch.tensor(table), torch.arange(seq_len), block)
        kv = torch.randn(seq_len, case["kv_heads"], case["entry_dim"], generator=g)
        for layout, cache in zip(layouts, caches):
            layout.write(cache, spec, slots, kv)
        slot_mapping += slots[seq_len - q_len :].tolist()
    meta = AttentionMetadata(
        torch.tensor([0] + [q for _, q in SEQS]).cumsum(0),
        torch.tensor([s for s, _ in SEQS]),
        torch.tensor(tables),
        torch.tensor(slot_mapping),
    )
    return caches, spec, meta


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ATTENTION.values(), ids=ATTENTION.keys())
def test_paged_attention_matches_reference(rw, case, dtype):
    ref_layout = ReferenceKVLayout(torch.device("cpu"), block_size=16)
    (mine, theirs), spec, meta = _paged_batch([rw.kv_layout, ref_layout], case, dtype)
    q = _randn(int(meta.query_start_loc[-1]), case["heads"], case["key_dim"], seed=9, dtype=dtype)
    kwargs = dict(scale=case["key_dim"] ** -0.5, value_dim=case["value_dim"], value_offset=case["value_offset"])
    got = rw.attention.paged_attention(q, mine, spec, meta, **kwargs)
    want = ReferenceAttention(ref_layout).paged_attention(q, theirs, spec, meta, **kwargs)
    assert got.shape == (q.shape[0], case["heads"], case["value_dim"]) and got.dtype == dtype
    torch.testing.assert_close(got, want)


# ------------------------------------------------------------------------------ batch invariance (bitwise)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_results_do_not_depend_on_the_batch(rw, dtype):
    ops, rows = rw.ops, [0, 1, 17, 36]
    x, w = _randn(37, 96, dtype=dtype, scale=3.0), _randn(80, 96, seed=1, dtype=dtype)
    xh, wh = _randn(37, 3, 16, seed=2, dtype=dtype), _randn(3, 8, 16, seed=3, dtype=dtype)
    cos, sin = _randn(64, 8, seed=4), _randn(64, 8, seed=5)
    positions = torch.arange(37) % 64
    route = _routing_cases()["noaux-tc"]
    w13, w2 = _randn(1, 64, 96, seed=6, dtype=dtype), _randn(1, 96, 32, seed=7, dtype=dtype)
    batched = {
        "linear": lambda s: ops.linear(x[s], w, w[0, :80]),
        "rms_norm": lambda s: ops.rms_norm(x[s], w[0], 1e-6),
        "silu_and_mul": lambda s: ops.silu_and_mul(x[s]),
        "head_linear": lambda s: ops.head_linear(xh[s], wh),
        "rotary": lambda s: ops.rotary(xh[s], positions[s], cos, sin, interleaved=True),
        "moe_route": lambda s: torch.cat(ops.moe_route(x[s, :16].float(), *route), dim=1),
        "expert_ffn": lambda s: ops.expert_ffn(x[s], torch.tensor([x[s].shape[0]]), w13, w2),
    }
    for name, op in batched.items():
        full = op(slice(None))
        for r in rows:
            assert torch.equal(op(slice(r, r + 1))[0], full[r]), (name, r)
        assert torch.equal(op(slice(10, 20)), full[10:20]), name


@pytest.mark.parametrize("case", ATTENTION.values(), ids=ATTENTION.keys())
def test_attention_row_is_the_same_alone_as_in_the_ragged_batch(rw, case):
    (cache,), spec, meta = _paged_batch([rw.kv_layout], case, torch.float32)
    q = _randn(int(meta.query_start_loc[-1]), case["heads"], case["key_dim"], seed=9)
    assert q.shape[0] == 37
    kwargs = dict(scale=0.3, value_dim=case["value_dim"], value_offset=case["value_offset"])
    full = rw.attention.paged_attention(q, cache, spec, meta, **kwargs)
    starts = meta.query_start_loc.tolist()
    for b, (seq_len, q_len) in enumerate(SEQS):
        for i in range(q_len):  # the same query as a decode of a sequence that ends at its position
            t = starts[b] + i
            context = torch.tensor([seq_len - q_len + i + 1])
            alone = AttentionMetadata(
                torch.tensor([0, 1]), context, meta.block_tables[b : b + 1], meta.slot_mapping[t : t + 1]
            )
            assert torch.equal(rw.attention.paged_attention(q[t : t + 1], cache, spec, alone, **kwargs)[0], full[t])


# ------------------------------------------------------------------------------ sampler

SAMPLING = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.4),
    SamplingParams(temperature=1.0, logprobs=5),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.1),
    SamplingParams(temperature=1.1, top_k=20, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=0.8, top_k=500, repetition_penalty=0.8, frequency_penalty=-0.5, presence_penalty=1.0),
]


def _sampling_case(repeats=4, vocab=100):
    params = [p for p in SAMPLING for _ in range(repeats)]
    rows = len(params)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(vocab, (int(n),), generator=g).tolist() for n in torch.randint(0, 9, (rows,), generator=g)]
    outputs = [torch.randint(vocab, (int(n),), generator=g).tolist() for n in torch.randint(0, 6, (rows,), generator=g)]
    seeds = [(2**64 - 1 - i) if i % 3 == 0 else 1000 + i for i in range(rows)]  # some with the top bit set
    logits = 3 * torch.randn(rows, vocab, generator=g)
    return logits, params, seeds, prompts, outputs


def test_sampler_matches_torch_sampler(rw):
    logits, params, seeds, prompts, outputs = _sampling_case()
    batch = SamplingBatch.build(params, seeds, prompts, outputs)
    got, want = rw.sampler.sample(logits, batch), TorchSampler().sample(logits, batch)
    assert torch.equal(got.token_ids, want.token_ids)
    assert torch.equal(got.top_token_ids, want.top_token_ids) and got.top_token_ids.shape == (len(params), 5)
    torch.testing.assert_close(got.logprobs, want.logprobs)
    torch.testing.assert_close(got.top_logprobs, want.top_logprobs)
    for p in (SAMPLING[:2], SAMPLING[3:5]):  # an all-greedy batch; no logprobs asked for
        batch = SamplingBatch.build(p, [1, 2], [[1, 2], []], [[3], [3, 3]])
        got, want = rw.sampler.sample(logits[:2], batch), TorchSampler().sample(logits[:2], batch)
        assert torch.equal(got.token_ids, want.token_ids) and got.top_logprobs.shape == (2, 0)


def test_sampled_row_does_not_depend_on_the_batch(rw):
    logits, params, seeds, prompts, outputs = _sampling_case(repeats=2)
    full = rw.sampler.sample(logits, SamplingBatch.build(params, seeds, prompts, outputs))
    for r in range(0, len(params), 3):
        alone = SamplingBatch.build(params[r : r + 1], seeds[r : r + 1], prompts[r : r + 1], outputs[r : r + 1])
        assert int(rw.sampler.sample(logits[r : r + 1], alone).token_ids[0]) == int(full.token_ids[r])


# ------------------------------------------------------------------------------ end to end


def test_generates_the_reference_tokens(rowwise_site, tiny_checkpoint):
    from deepinfer_core.engine.llm import LLM

    prompts = [[5, 6, 7, 8], list(range(20, 57))]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for accelerator in ("cpu", "rowwise_cpu"):
        llm = LLM(model=tiny_checkpoint, accelerator=accelerator, progress=False, num_kv_blocks=32)
        tokens[accelerator] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert tokens["rowwise_cpu"] == tokens["cpu"]
    assert llm.backend.info.name == "rowwise_cpu" and llm.backend.kv_layout.block_size == 64
    # batch invariance end to end: a seeded request gives the same tokens alone and in a batch
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=6, ignore_eos=True)
    alone = llm.generate([[9, 8, 7]], seeded)[0].outputs[0].token_ids
    batch = llm.generate([[1, 2, 3, 4, 5], [9, 8, 7], list(range(40, 70))], seeded)
    assert batch[1].outputs[0].token_ids == alone
