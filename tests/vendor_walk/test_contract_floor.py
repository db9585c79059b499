"""Every type a vendor implements comes from the contract, `deepinfer_core.backend`, and the contract stands
on the floor (backend, kv, sampling, parallel, errors): it never imports the engine, models, server or CLI."""

from __future__ import annotations

import ast
from pathlib import Path

import deepinfer_core.backend as contract

BACKEND = Path(contract.__file__).parent
FLOOR = ("backend", "kv", "sampling", "parallel", "errors")


def core_imports(path: Path) -> set[str]:
    """The deepinfer_core modules `path` imports, as names relative to deepinfer_core."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
        found |= {n.removeprefix("deepinfer_core.") for n in names if n.startswith("deepinfer_core.")}
    return found


def test_the_contract_imports_only_the_floor():
    above = {
        path.name: sorted(m for m in core_imports(path) if m.split(".")[0] not in FLOOR)
        for path in sorted(BACKEND.glob("*.py"))
    }
    assert not {name: mods for name, mods in above.items() if mods}, above


def test_the_check_sees_an_engine_import(tmp_path):
    source = tmp_path / "x.py"
    source.write_text("from deepinfer_core.engine.cost import CostModel\nimport deepinfer_core.kv.layout\n")
    assert core_imports(source) == {"engine.cost", "kv.layout"}


def test_what_a_vendor_implements_is_exported_by_the_contract():
    from deepinfer_core.kv.layout import KVLayout
    from deepinfer_core.parallel.communicator import ExpertCommunicator
    from deepinfer_core.sampling.sampler import Sampler

    for name in ("Ops", "AttentionOps", "V4Ops", "V4AttentionOps", "CostModel", "GraphCapture", "LinearCostModel"):
        assert name in contract.__all__ and hasattr(contract, name), name
    hookspecs = (BACKEND / "hookspecs.py").read_text()
    for protocol in (KVLayout, ExpertCommunicator, Sampler):  # the hooks' other return types, from the floor
        assert protocol.__name__ in hookspecs


def test_the_engine_paths_still_name_the_same_types():
    from deepinfer_core.engine import cost, graphs

    assert cost.CostModel is contract.CostModel and cost.LinearCostModel is contract.LinearCostModel
    assert graphs.GraphCapture is contract.GraphCapture
