"""Expert-parallel dispatch/combine of the backend's communicator, for world sizes 1, 2 and 4.

World size 1 runs in this process with the communicator `resolve_backend(entry, world_size=1, rank=0)`
returns, on the backend's device. World sizes 2 and 4 are real torch.distributed worlds of CPU
processes over gloo (backends that list "torch_distributed:gloo" in Capabilities.communicators): each
rank is a plain subprocess running _dispatch_worker.py, which discovers the backends, resolves the one
under test with (world_size, rank) and runs every scenario on its own tokens. A world is spawned once
and runs all scenarios; it is killed and its cases fail, with every rank's log, if it runs too long.

Expected, on every rank: what InProcessCommunicator (the reference) gives for that rank's tokens with
the same expert function. Bitwise for an elementwise expert (combine sums the top-k contributions in
routing order in float32, so the result does not depend on the world size), within tolerance for a
per-expert linear layer (its GEMMs see different row batches on different ranks).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch

from deepinfer_core.parallel.communicator import InProcessCommunicator

WORKER_PATH = Path(__file__).with_name("_dispatch_worker.py")
GLOO = "torch_distributed:gloo"
WORLD_TIMEOUT_S = 90.0  # one whole world, spawn to exit


def _load_worker_module():
    name = "deepinfer_conformance_dispatch_worker"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, WORKER_PATH)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


W = _load_worker_module()
SCENARIOS = list(W.scenarios(1))  # the same names for every world size
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _resolve_dtype(suite) -> torch.dtype:
    """The compute dtype the backend is resolved in (communicators move any dtype; float32 preferred)."""
    for name, dtype in _DTYPES.items():
        if name in suite.capabilities.dtypes:
            return dtype
    pytest.skip(f"{suite.under_test.name} declares no compute dtype this suite knows ({suite.capabilities.dtypes})")


# ---------------------------------------------------------------------------------------------
# Worlds
# ---------------------------------------------------------------------------------------------


def _run_in_process(suite, scenarios: dict) -> list[dict]:
    """World size 1: the backend's own communicator for (world_size=1, rank=0), on its device."""
    from deepinfer_core.backend.resolve import resolve_backend

    resolved = resolve_backend(suite.under_test, dtype=_resolve_dtype(suite), world_size=1, rank=0)
    comm = resolved.communicator
    res = {"communicator": type(comm).__name__, "rank": comm.rank, "world_size": comm.world_size}
    for name, scenario in scenarios.items():
        try:
            res[name] = W.run_scenario(comm, scenario, scenario["inputs"][0], 0, 1, device=resolved.torch_device)
        except Exception:  # noqa: BLE001 - reported by the scenario's cases
            res[name] = {"error": traceback.format_exc()}
    return [res]


def _require_gloo_world(suite) -> None:
    name = suite.under_test.name
    suite.require_declared("communicators", GLOO, why="multi-process dispatch is tested over gloo")
    if not torch.distributed.is_available():
        pytest.skip("this torch build has no torch.distributed")
    device = suite.resolved(suite.under_test, _resolve_dtype(suite)).device.torch_device
    if torch.device(device).type != "cpu":
        pytest.skip(
            f"{name} runs on {device!r}, not cpu; multi-process dispatch is tested only in gloo worlds "
            f"of CPU processes for now"
        )


def _logs(work_dir: Path, world_size: int) -> str:
    parts = []
    for rank in range(world_size):
        path = work_dir / f"rank{rank}.log"
        text = path.read_text(errors="replace")[-4000:] if path.exists() else "<no log>"
        parts.append(f"--- rank {rank} stdout/stderr ---\n{text}")
    return "\n".join(parts)


def _run_world(suite, world_size: int, scenarios: dict, work_dir: Path) -> list[dict]:
    """Spawn `world_size` gloo ranks that run every scenario; return each rank's results."""
    in_path = work_dir / "inputs.pt"
    torch.save({"backend": suite.under_test.name, "dtype": _resolve_dtype(suite), "scenarios": scenarios}, in_path)
    init_file = work_dir / "rendezvous"  # file:// store; must not exist beforehand
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs, logs = [], []
    started = time.monotonic()
    deadline = started + WORLD_TIMEOUT_S
    timed_out, killed = False, []
    try:
        for rank in range(world_size):
            log = open(work_dir / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed below
            logs.append(log)
            cmd = [
                sys.executable,
                str(WORKER_PATH),
                str(rank),
                str(world_size),
                str(init_file),
                str(in_path),
                str(work_dir),
            ]
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
        for proc in procs:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:  # also on KeyboardInterrupt: never leave a rank behind
        for rank, proc in enumerate(procs):
            if proc.poll() is None:
                killed.append(rank)
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    if timed_out:
        pytest.fail(
            f"gloo world of {world_size} ranks did not finish in {WORLD_TIMEOUT_S:.0f}s; killed the ranks "
            f"still running ({', '.join(map(str, killed))}):\n" + _logs(work_dir, world_size)
        )
    results = []
    for rank, proc in enumerate(procs):
        path = work_dir / f"rank{rank}.pt"
        if proc.returncode != 0 or not path.exists():
            pytest.fail(f"rank {rank} of {world_size} exited with {proc.returncode}:\n" + _logs(work_dir, world_size))
        res = torch.load(path, weights_only=False)
        if "fatal" in res:
            pytest.fail(f"rank {rank} of {world_size} failed:\n{res['fatal']}\n" + _logs(work_dir, world_size))
        results.append(res)
    results[0]["world_seconds"] = time.monotonic() - started
    return results


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda w: f"world{w}")
def world(request, suite, tmp_path_factory):
    """(world_size, scenarios, per-rank results); one world per size for the whole module."""
    world_size = request.param
    scenarios = W.scenarios(world_size)
    if world_size == 1:
        return world_size, scenarios, _run_in_process(suite, scenarios)
    _require_gloo_world(suite)
    work_dir = tmp_path_factory.mktemp(f"world{world_size}")
    return world_size, scenarios, _run_world(suite, world_size, scenarios, work_dir)


def _scenario(world, name: str):
    world_size, scenarios, results = world
    summary, details = [], []
    for rank, res in enumerate(results):
        if name not in res:
            summary.append(f"rank {rank}: did not run it (an earlier scenario failed)")
        elif "error" in res[name]:
            summary.append(f"rank {rank}: {res[name]['error'].strip().splitlines()[-1][:160]}")
            details.append(f"--- rank {rank} ---\n{res[name]['error']}")
    if summary:  # every rank's story: one rank's failure often shows on its peers as a closed connection
        pytest.fail(
            f"scenario {name!r} failed in the world of {world_size}: " + "; ".join(summary) + "\n" + "\n".join(details)
        )
    return world_size, scenarios[name], [res[name] for res in results]


def _reference(inp: dict, num_experts: int, expert_fn) -> torch.Tensor:
    """InProcessCommunicator over one rank's tokens, with the same expert function."""
    comm = InProcessCommunicator()
    d = comm.dispatch(inp["hidden"], inp["topk_ids"], num_experts)
    return comm.combine(expert_fn(d.hidden, W.row_expert_ids(d.tokens_per_expert, 0)), d, inp["topk_weights"])


def _by_tag(rows: torch.Tensor) -> torch.Tensor:
    return rows[rows[:, 0].float().argsort(stable=True)]


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------


def test_communicator_rank_and_world_size(world, check):
    world_size, _, results = world
    check.metric(
        communicator=results[0]["communicator"],
        world_size=world_size,
        world_seconds=round(results[0].get("world_seconds", 0.0), 2),
    )
    got = [(res["rank"], res["world_size"]) for res in results]
    assert got == [(r, world_size) for r in range(world_size)], f"(rank, world_size) per rank: {got}"
    for rank, res in enumerate(results):
        assert "teardown" not in res, f"rank {rank}: barrier/destroy_process_group failed:\n{res['teardown']}"


@pytest.mark.parametrize("name", SCENARIOS)
def test_dispatch_delivers_rows_of_local_experts(world, check, name):
    world_size, scenario, per_rank = _scenario(world, name)
    num_experts = scenario["num_experts"]
    local = num_experts // world_size
    everyone = scenario["inputs"]  # every rank's tokens: a rank's experts receive rows from all of them
    got_counts, want_counts, got_rows, want_rows = [], [], [], []
    for rank, res in enumerate(per_rank):
        tpe = res["tokens_per_expert"]
        assert tpe.shape == (local,), f"rank {rank}: tokens_per_expert has shape {tuple(tpe.shape)}, not ({local},)"
        assert int(tpe.sum()) == res["rows"].shape[0], f"rank {rank}: tokens_per_expert does not sum to the rows"
        got_counts.append(tpe.to(torch.int64))
        for j, group in enumerate(res["rows"].split(tpe.tolist())):
            g = rank * local + j
            routed = torch.cat([inp["hidden"][(inp["topk_ids"] == g).any(dim=1)] for inp in everyone])
            want_counts.append(torch.tensor([routed.shape[0]]))
            got_rows.append(_by_tag(group))  # order within an expert's group is free
            want_rows.append(_by_tag(routed))
    check.equal(torch.cat(got_counts), torch.cat(want_counts), what="tokens_per_expert on every rank")
    check.equal(torch.cat(got_rows), torch.cat(want_rows), what="rows of each local expert (sorted by token)")


@pytest.mark.parametrize("name", SCENARIOS)
def test_combine_elementwise_experts_bitwise(world, check, name):
    _, scenario, per_rank = _scenario(world, name)
    got = [res["elementwise"] for res in per_rank]
    want = [
        _reference(scenario["inputs"][rank], scenario["num_experts"], W.elementwise_expert)
        for rank in range(len(per_rank))
    ]
    for rank, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, (
            f"rank {rank}: combined {tuple(g.shape)}/{g.dtype}, expected {tuple(w.shape)}/{w.dtype}"
        )
    check.equal(torch.cat(got), torch.cat(want), what="combined output of every rank")


@pytest.mark.parametrize("name", SCENARIOS)
def test_combine_linear_experts(world, check, name):
    _, scenario, per_rank = _scenario(world, name)

    def linear(rows, ids):
        return W.linear_expert(rows, ids, scenario["weight"], scenario["bias"])

    got = torch.cat([res["linear"] for res in per_rank])
    want = torch.cat(
        [_reference(scenario["inputs"][rank], scenario["num_experts"], linear) for rank in range(len(per_rank))]
    )
    dim = want.shape[1]
    check.close(got, want, scenario["dtype"], reduce_dim=dim, what="combined output of every rank")
