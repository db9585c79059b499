"""Tests for expert-parallel dispatch/combine (deepinfer_core.parallel.communicator).

InProcessCommunicator is checked against explicit per-token loops. AllToAllCommunicator is run in
real gloo worlds of 2 and 4 CPU processes (one world per size, shared by every scenario) and its
output on each rank is compared with what InProcessCommunicator computes for that rank's tokens.

The workers are plain subprocesses that load this file by path and call `_worker_main`, so they do
not depend on pytest's import mode. Inputs go to the workers and results come back through files
in a tmp directory; the whole world is killed and the test fails if it runs past `_WORLD_TIMEOUT_S`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from deepinfer_core.parallel.communicator import AllToAllCommunicator, Dispatched, InProcessCommunicator

_WORLD_TIMEOUT_S = 120.0  # whole world, spawn to exit
_GLOO_TIMEOUT_S = 30.0  # a single collective inside a worker


# ---------------------------------------------------------------------------------------------
# Expert functions, shared by the workers and the in-process references.
# ---------------------------------------------------------------------------------------------


def _row_expert_ids(tokens_per_expert: torch.Tensor, first_expert: int) -> torch.Tensor:
    """Global expert id of every dispatched row (rows are grouped by local expert)."""
    local = torch.arange(tokens_per_expert.numel(), dtype=torch.int64)
    return torch.repeat_interleave(local + first_expert, tokens_per_expert)


def _elementwise_expert(rows: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """rows * (g + 1) + g, elementwise, so every implementation gets bit-identical values."""
    g = expert_ids.to(rows.dtype)[:, None]
    return rows * (g + 1) + g


def _linear_expert(
    rows: torch.Tensor, expert_ids: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """A per-expert linear layer: rows of expert g -> rows @ weight[g].T + bias[g]."""
    out = torch.zeros_like(rows)
    for g in expert_ids.unique().tolist():
        mask = expert_ids == g
        out[mask] = rows[mask] @ weight[g].T + bias[g]
    return out


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def _routing(gen: torch.Generator, tokens: int, top_k: int, experts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, K] with distinct experts per token, drawn from `experts`; weights [T, K]."""
    pool = torch.tensor(experts, dtype=torch.int64)
    pick = torch.rand(tokens, len(experts), generator=gen).argsort(dim=1)[:, :top_k]
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    return pool[pick], weights


def _tagged_hidden(gen: torch.Generator, tokens: int, dim: int, first_tag: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows whose column 0 is a unique integer tag, so a row can be traced to its token."""
    hidden = torch.randn(tokens, dim, generator=gen)
    hidden[:, 0] = torch.arange(first_tag, first_tag + tokens, dtype=torch.float32)
    return hidden.to(dtype)


def _make_scenario(
    seed: int,
    token_counts: list[int],
    num_experts: int,
    top_k: int,
    unused_experts: tuple[int, ...] = (),
    dim: int = 16,
    dtype: torch.dtype = torch.float32,
) -> dict:
    gen = torch.Generator().manual_seed(seed)
    experts = [e for e in range(num_experts) if e not in unused_experts]
    inputs, tag = [], 0
    for tokens in token_counts:
        hidden = _tagged_hidden(gen, tokens, dim, tag, dtype)
        topk_ids, topk_weights = _routing(gen, tokens, top_k, experts)
        inputs.append({"hidden": hidden, "topk_ids": topk_ids, "topk_weights": topk_weights})
        tag += tokens
    weight = torch.randn(num_experts, dim, dim, generator=gen) / dim**0.5
    bias = torch.randn(num_experts, dim, generator=gen)
    return {
        "num_experts": num_experts,
        "unused_experts": list(unused_experts),
        "inputs": inputs,
        "weight": weight.to(dtype),
        "bias": bias.to(dtype),
    }


# Every world runs every scenario name; the same names exist for both world sizes.
_SCENARIOS: dict[int, dict[str, dict]] = {
    2: {
        # experts 3 (rank 0) and 6 (rank 1) receive nothing
        "k2_unused_experts": _make_scenario(1, [5, 9], 8, 2, unused_experts=(3, 6)),
        "k3_uneven_counts": _make_scenario(2, [13, 3], 8, 3, unused_experts=(1,)),
        # rank 0 sends nothing; rank 1 (experts 4..7) receives nothing
        "rank_without_tokens": _make_scenario(3, [0, 7], 8, 2, unused_experts=(4, 5, 6, 7)),
        "bf16": _make_scenario(4, [6, 4], 4, 2, dtype=torch.bfloat16),
    },
    4: {
        "k2_unused_experts": _make_scenario(11, [4, 5, 6, 7], 8, 2, unused_experts=(5,)),
        "k3_uneven_counts": _make_scenario(12, [9, 2, 5, 1], 16, 3, unused_experts=(0, 9, 10)),
        # rank 1 sends nothing; rank 3 (experts 6, 7) receives nothing
        "rank_without_tokens": _make_scenario(13, [3, 0, 11, 6], 8, 3, unused_experts=(6, 7)),
        "bf16": _make_scenario(14, [2, 5, 3, 4], 8, 2, dtype=torch.bfloat16),
    },
}
_SCENARIO_NAMES = ["k2_unused_experts", "k3_uneven_counts", "bf16", "rank_without_tokens"]  # run in this order
_FLOAT32_SCENARIOS = [n for n in _SCENARIO_NAMES if n != "bf16"]  # linear experts: tolerance needs float32
assert all(sorted(s) == sorted(_SCENARIO_NAMES) for s in _SCENARIOS.values())


def _bad_num_experts(world_size: int) -> int:
    return 2 * world_size + 1


# ---------------------------------------------------------------------------------------------
# Worker (runs in a subprocess; see _BOOT)
# ---------------------------------------------------------------------------------------------


def _worker_main(argv: list[str]) -> None:
    import torch.distributed as dist

    rank, world_size = int(argv[0]), int(argv[1])
    init_file, in_path, out_dir = Path(argv[2]), Path(argv[3]), Path(argv[4])
    torch.set_num_threads(1)
    results: dict = {}
    try:
        spec = torch.load(in_path)
        dist.init_process_group(
            "gloo",
            init_method=init_file.as_uri(),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=_GLOO_TIMEOUT_S),
        )
        comm = AllToAllCommunicator()
        results["rank"], results["world_size"] = comm.rank, comm.world_size

        # An uneven expert split must fail before any collective, on every rank alike.
        bad = spec["bad_num_experts"]
        try:
            comm.dispatch(torch.zeros(2, 4), torch.zeros(2, 2, dtype=torch.int64), bad)
            results["bad_split"] = {"type": None, "message": "no exception"}
        except Exception as exc:  # noqa: BLE001 - the type is what the test checks
            results["bad_split"] = {"type": type(exc).__name__, "message": str(exc)}

        for name in spec["order"]:
            scenario = spec["scenarios"][name]
            inp = scenario["inputs"][rank]
            try:
                num_experts = scenario["num_experts"]
                d = comm.dispatch(inp["hidden"], inp["topk_ids"], num_experts)
                first = rank * (num_experts // world_size)
                ids = _row_expert_ids(d.tokens_per_expert, first)
                elementwise = comm.combine(_elementwise_expert(d.hidden, ids), d, inp["topk_weights"])
                linear = comm.combine(
                    _linear_expert(d.hidden, ids, scenario["weight"], scenario["bias"]), d, inp["topk_weights"]
                )
                # the weights travel with their rows: applied before combine, which then sums with weight 1
                weighted = comm.dispatch(inp["hidden"], inp["topk_ids"], num_experts, inp["topk_weights"])
                scaled = _elementwise_expert(weighted.hidden, ids).float() * weighted.row_weights[:, None]
                ones = torch.ones_like(inp["topk_weights"])
                results[name] = {
                    "rows": d.hidden,
                    "tokens_per_expert": d.tokens_per_expert,
                    "elementwise": elementwise,
                    "linear": linear,
                    "same_rows_with_weights": torch.equal(weighted.hidden, d.hidden),
                    "row_weights": weighted.row_weights,
                    "weighted_before": comm.combine(scaled.to(d.hidden.dtype), weighted, ones),
                }
            except Exception:  # noqa: BLE001 - reported per scenario; later collectives would not line up
                results[name] = {"error": traceback.format_exc()}
                return  # skip the rest; peers see the connection close (or the gloo timeout) and stop too
        try:
            dist.barrier()
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - e.g. a peer that failed its last scenario already left
            results["teardown"] = traceback.format_exc()
    except Exception:  # noqa: BLE001
        results["fatal"] = traceback.format_exc()
    finally:
        tmp = out_dir / f"rank{rank}.pt.tmp"
        torch.save(results, tmp)
        tmp.rename(out_dir / f"rank{rank}.pt")
        if dist.is_initialized():
            # Left early with a live gloo group: a normal interpreter exit would abort in its threads.
            sys.stdout.flush()
            os._exit(0)


_BOOT = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('_ep_communicator_worker', sys.argv[1])\n"
    "mod = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(mod)\n"
    "mod._worker_main(sys.argv[2:])\n"
)


def _run_world(world_size: int, work_dir: Path) -> list[dict]:
    """Spawn `world_size` gloo workers over every scenario; return each rank's results."""
    in_path = work_dir / "inputs.pt"
    torch.save(
        {
            "scenarios": _SCENARIOS[world_size],
            "order": _SCENARIO_NAMES,
            "bad_num_experts": _bad_num_experts(world_size),
        },
        in_path,
    )
    init_file = work_dir / "rendezvous"  # file:// store; must not exist beforehand
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs, logs = [], []
    for rank in range(world_size):
        log = open(work_dir / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed below
        logs.append(log)
        cmd = [
            sys.executable,
            "-c",
            _BOOT,
            __file__,
            str(rank),
            str(world_size),
            str(init_file),
            str(in_path),
            str(work_dir),
        ]
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + _WORLD_TIMEOUT_S
    timed_out = False
    try:
        for proc in procs:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:  # also on KeyboardInterrupt: never leave a rank behind
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    if timed_out:
        pytest.fail(
            f"world of {world_size} gloo ranks did not finish in {_WORLD_TIMEOUT_S}s (killed):\n"
            + _logs(work_dir, world_size)
        )

    results = []
    for rank, proc in enumerate(procs):
        path = work_dir / f"rank{rank}.pt"
        if proc.returncode != 0 or not path.exists():
            pytest.fail(f"rank {rank} exited with {proc.returncode}:\n" + _logs(work_dir, world_size))
        res = torch.load(path)
        if "fatal" in res:
            pytest.fail(f"rank {rank} failed:\n{res['fatal']}\n" + _logs(work_dir, world_size))
        results.append(res)
    return results


def _logs(work_dir: Path, world_size: int) -> str:
    parts = []
    for rank in range(world_size):
        path = work_dir / f"rank{rank}.log"
        text = path.read_text(errors="replace")[-4000:] if path.exists() else "<no log>"
        parts.append(f"--- rank {rank} ---\n{text}")
    return "\n".join(parts)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def world(request, tmp_path_factory) -> tuple[int, list[dict]]:
    world_size = request.param
    return world_size, _run_world(world_size, tmp_path_factory.mktemp(f"gloo_world{world_size}"))


def _scenario_results(world: tuple[int, list[dict]], name: str) -> tuple[int, dict, list[dict]]:
    world_size, results = world
    problems = []
    for rank, res in enumerate(results):
        if name not in res:
            problems.append(f"rank {rank} never ran scenario {name!r} (an earlier scenario failed)")
        elif "error" in res[name]:
            problems.append(f"rank {rank} raised in scenario {name!r}:\n{res[name]['error']}")
    if problems:  # every rank's story: the first failure is often a peer's reaction to another rank's
        pytest.fail("\n".join(problems))
    return world_size, _SCENARIOS[world_size][name], [res[name] for res in results]


def _in_process_reference(inp: dict, num_experts: int, expert_fn) -> torch.Tensor:
    comm = InProcessCommunicator()
    d = comm.dispatch(inp["hidden"], inp["topk_ids"], num_experts)
    ids = _row_expert_ids(d.tokens_per_expert, 0)
    return comm.combine(expert_fn(d.hidden, ids), d, inp["topk_weights"])


def _sorted_by_tag(rows: torch.Tensor) -> torch.Tensor:
    return rows[rows[:, 0].float().argsort()]


# ---------------------------------------------------------------------------------------------
# InProcessCommunicator
# ---------------------------------------------------------------------------------------------

_IN_PROCESS_CASES = [
    # tokens, num_experts, top_k, unused experts
    pytest.param(1, 4, 1, (), id="one_token_k1"),
    pytest.param(7, 8, 2, (2, 5), id="k2_unused_experts"),
    pytest.param(20, 8, 3, (0, 7), id="k3_unused_first_last"),
    pytest.param(33, 16, 4, (), id="k4_e16"),
]


def _in_process_inputs(seed: int, tokens: int, num_experts: int, top_k: int, unused: tuple[int, ...], dim: int = 12):
    gen = torch.Generator().manual_seed(seed)
    hidden = _tagged_hidden(gen, tokens, dim, 0, torch.float32)
    topk_ids, topk_weights = _routing(gen, tokens, top_k, [e for e in range(num_experts) if e not in unused])
    return hidden, topk_ids, topk_weights


@pytest.mark.parametrize(("tokens", "num_experts", "top_k", "unused"), _IN_PROCESS_CASES)
def test_in_process_dispatch_groups_rows_by_expert(tokens, num_experts, top_k, unused):
    hidden, topk_ids, _ = _in_process_inputs(0, tokens, num_experts, top_k, unused)
    d = InProcessCommunicator().dispatch(hidden, topk_ids, num_experts)

    assert isinstance(d, Dispatched)
    assert d.tokens_per_expert.dtype == torch.int64
    assert torch.equal(d.tokens_per_expert, torch.bincount(topk_ids.reshape(-1), minlength=num_experts))
    assert d.hidden.shape == (tokens * top_k, hidden.shape[1])
    for e in unused:
        assert d.tokens_per_expert[e] == 0
    groups = d.hidden.split(d.tokens_per_expert.tolist())
    for e, group in enumerate(groups):
        routed = hidden[(topk_ids == e).any(dim=1)]
        assert torch.equal(_sorted_by_tag(group), _sorted_by_tag(routed)), f"expert {e} got the wrong rows"


@pytest.mark.parametrize(("tokens", "num_experts", "top_k", "unused"), _IN_PROCESS_CASES)
def test_in_process_identity_experts_give_weighted_sum(tokens, num_experts, top_k, unused):
    hidden, topk_ids, topk_weights = _in_process_inputs(1, tokens, num_experts, top_k, unused)
    comm = InProcessCommunicator()
    d = comm.dispatch(hidden, topk_ids, num_experts)
    out = comm.combine(d.hidden, d, topk_weights)

    expected = torch.zeros_like(hidden)
    for k in range(top_k):
        expected += topk_weights[:, k : k + 1] * hidden
    assert out.shape == hidden.shape and out.dtype == hidden.dtype
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize(("tokens", "num_experts", "top_k", "unused"), _IN_PROCESS_CASES)
def test_in_process_expert_dependent_combine_matches_token_loop(tokens, num_experts, top_k, unused):
    hidden, topk_ids, topk_weights = _in_process_inputs(2, tokens, num_experts, top_k, unused)
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(num_experts, hidden.shape[1], hidden.shape[1], generator=gen)
    bias = torch.randn(num_experts, hidden.shape[1], generator=gen)
    comm = InProcessCommunicator()
    d = comm.dispatch(hidden, topk_ids, num_experts)
    ids = _row_expert_ids(d.tokens_per_expert, 0)

    out_elem = comm.combine(_elementwise_expert(d.hidden, ids), d, topk_weights)
    out_lin = comm.combine(_linear_expert(d.hidden, ids, weight, bias), d, topk_weights)

    exp_elem = torch.zeros_like(hidden)
    exp_lin = torch.zeros_like(hidden)
    for t in range(tokens):
        for k in range(top_k):
            g = int(topk_ids[t, k])
            w = topk_weights[t, k]
            exp_elem[t] += w * (hidden[t] * (g + 1) + g)
            exp_lin[t] += w * (weight[g] @ hidden[t] + bias[g])
    torch.testing.assert_close(out_elem, exp_elem)
    torch.testing.assert_close(out_lin, exp_lin)


def test_in_process_combine_is_float32_sum_in_low_precision():
    """bf16 expert outputs are summed in float32 and rounded once, as the module docstring says."""
    hidden, topk_ids, topk_weights = _in_process_inputs(4, 9, 4, 2, ())
    hidden = hidden.to(torch.bfloat16)
    comm = InProcessCommunicator()
    d = comm.dispatch(hidden, topk_ids, 4)
    out = comm.combine(d.hidden, d, topk_weights)
    expected = (hidden.float()[:, None, :] * topk_weights[:, :, None]).sum(dim=1)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, expected.to(torch.bfloat16))


@pytest.mark.parametrize(("tokens", "num_experts", "top_k", "unused"), _IN_PROCESS_CASES)
def test_in_process_dispatch_gives_each_row_its_routing_weight(tokens, num_experts, top_k, unused):
    hidden, topk_ids, topk_weights = _in_process_inputs(5, tokens, num_experts, top_k, unused)
    comm = InProcessCommunicator()
    d = comm.dispatch(hidden, topk_ids, num_experts, topk_weights)
    assert comm.dispatch(hidden, topk_ids, num_experts).row_weights is None
    assert d.row_weights.dtype == torch.float32 and d.row_weights.shape == (tokens * top_k,)
    ids = _row_expert_ids(d.tokens_per_expert, 0)
    for row, expert in enumerate(ids.tolist()):  # the row's token (by its tag) routed to this expert with it
        token = int(d.hidden[row, 0])
        (k,) = (topk_ids[token] == expert).nonzero()[0].tolist()
        assert d.row_weights[row] == topk_weights[token, k]
    scaled = comm.combine(d.hidden * d.row_weights[:, None], d, torch.ones_like(topk_weights))
    torch.testing.assert_close(scaled, comm.combine(d.hidden, d, topk_weights))


def test_in_process_handles_zero_tokens():
    hidden = torch.zeros(0, 6)
    topk_ids = torch.zeros(0, 2, dtype=torch.int64)
    comm = InProcessCommunicator()
    d = comm.dispatch(hidden, topk_ids, 4)
    assert d.hidden.shape == (0, 6)
    assert torch.equal(d.tokens_per_expert, torch.zeros(4, dtype=torch.int64))
    out = comm.combine(d.hidden, d, torch.zeros(0, 2))
    assert out.shape == (0, 6)


# ---------------------------------------------------------------------------------------------
# AllToAllCommunicator
# ---------------------------------------------------------------------------------------------


def test_all_to_all_without_process_group_raises_runtime_error():
    import torch.distributed as dist

    assert not dist.is_initialized()  # the gloo worlds live in subprocesses
    with pytest.raises(RuntimeError, match="init_process_group"):
        AllToAllCommunicator()


def test_all_to_all_reports_rank_and_world_size(world):
    world_size, results = world
    assert [(r["rank"], r["world_size"]) for r in results] == [(r, world_size) for r in range(world_size)]


def test_all_to_all_world_shuts_down_cleanly(world):
    _, results = world
    for rank, res in enumerate(results):
        assert all(name in res and "error" not in res[name] for name in _SCENARIO_NAMES), (
            f"rank {rank}: a scenario failed"
        )
        assert "teardown" not in res, f"rank {rank}: barrier/destroy failed:\n{res['teardown']}"


def test_all_to_all_uneven_expert_split_raises_value_error(world):
    world_size, results = world
    bad = _bad_num_experts(world_size)
    for rank, res in enumerate(results):
        assert res["bad_split"]["type"] == "ValueError", f"rank {rank}: {res['bad_split']}"
        message = res["bad_split"]["message"]
        assert re.search(rf"\b{bad}\b.*experts.*\b{world_size}\b.*ranks", message), message


@pytest.mark.parametrize("name", _SCENARIO_NAMES)
def test_all_to_all_dispatch_delivers_rows_of_local_experts(world, name):
    world_size, scenario, per_rank = _scenario_results(world, name)
    num_experts = scenario["num_experts"]
    local = num_experts // world_size
    inputs = scenario["inputs"]
    for rank, res in enumerate(per_rank):
        tpe = res["tokens_per_expert"]
        assert tpe.dtype == torch.int64
        assert tpe.shape == (local,), f"rank {rank}: tokens_per_expert {tuple(tpe.shape)} != ({local},)"
        assert int(tpe.sum()) == res["rows"].shape[0]
        for j, group in enumerate(res["rows"].split(tpe.tolist())):
            g = rank * local + j
            routed = torch.cat([inp["hidden"][(inp["topk_ids"] == g).any(dim=1)] for inp in inputs])
            assert int(tpe[j]) == routed.shape[0], f"rank {rank}, expert {g}: count {int(tpe[j])} != {routed.shape[0]}"
            if g in scenario["unused_experts"]:
                assert group.shape[0] == 0
            assert torch.equal(_sorted_by_tag(group), _sorted_by_tag(routed)), f"rank {rank}, expert {g}: wrong rows"


@pytest.mark.parametrize("name", _SCENARIO_NAMES)
def test_all_to_all_combine_bitwise_equals_in_process(world, name):
    _, scenario, per_rank = _scenario_results(world, name)
    for rank, res in enumerate(per_rank):
        inp = scenario["inputs"][rank]
        expected = _in_process_reference(inp, scenario["num_experts"], _elementwise_expert)
        got = res["elementwise"]
        assert got.shape == inp["hidden"].shape and got.dtype == inp["hidden"].dtype
        assert torch.equal(got, expected), f"rank {rank}: max diff {(got.float() - expected.float()).abs().max()}"


@pytest.mark.parametrize("name", _FLOAT32_SCENARIOS)
def test_all_to_all_combine_linear_experts_matches_in_process(world, name):
    _, scenario, per_rank = _scenario_results(world, name)

    def linear(rows, ids):
        return _linear_expert(rows, ids, scenario["weight"], scenario["bias"])

    for rank, res in enumerate(per_rank):
        inp = scenario["inputs"][rank]
        expected = _in_process_reference(inp, scenario["num_experts"], linear)
        assert res["linear"].shape == inp["hidden"].shape
        torch.testing.assert_close(res["linear"], expected, rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("name", _SCENARIO_NAMES)
def test_all_to_all_row_weights_travel_with_their_rows(world, name):
    """Weights applied to the rows before combine (DeepSeek-V4.1's order) give the weighted combine: each
    row got its own token's weight for that expert, on every rank, whatever the world size."""
    _, scenario, results = _scenario_results(world, name)
    for rank, res in enumerate(results):
        assert res["same_rows_with_weights"], f"rank {rank}: dispatching the weights changed the rows"
        assert res["row_weights"].dtype == torch.float32 and res["row_weights"].shape == (res["rows"].shape[0],)
        low = res["rows"].dtype == torch.bfloat16  # the scaled rows are rounded to bf16 before combine
        tolerance = {"atol": 2e-2, "rtol": 2e-2} if low else {}
        torch.testing.assert_close(res["weighted_before"], res["elementwise"], **tolerance)
