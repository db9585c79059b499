"""The ascend950 backend's torch_npu calls against the real torch_npu wheel's op schemas, and proof that the
check fails: each real call, mutated in memory (op misspelled, keyword misspelled, a required argument
dropped, a positional argument too many), must be reported."""

from __future__ import annotations

import ast
from pathlib import Path

import npu_schema_check as check
import pytest

BACKEND_CALLS = check.find_npu_calls(check.BACKEND_DIR)
CORE_OPS = {"npu_rms_norm", "npu_fused_infer_attention_score", "npu_grouped_matmul", "npu_moe_gating_top_k"}


def _call_id(call: check.Call) -> str:
    return f"{Path(call.file).name}:{call.line}:{call.op}"


def _node(tree: ast.AST, call: check.Call) -> ast.Call:
    return next(
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and node.lineno == call.line and getattr(node.func, "attr", None) == call.op
    )


def _has_keyword(call: check.Call) -> bool:
    return any(kw.arg for kw in _node(ast.parse(Path(call.file).read_text()), call).keywords)


def _check_mutated(call: check.Call, mutate, tmp_path: Path, schemas) -> list[str]:
    """Problems in the call's file after `mutate(node)` changed that call (the rest of the file unchanged)."""
    tree = ast.parse(Path(call.file).read_text())
    mutate(_node(tree, call))
    mutated = tmp_path / Path(call.file).name
    mutated.write_text(ast.unparse(tree))
    return check.check_tree(mutated, schemas)[1]


def _swap_last_letters(name: str) -> str:
    return name[:-2] + name[-1] + name[-2]


def _overloads(schemas, op: str):
    return [schema for key, schema in schemas.items() if key.split(".")[0] == op]


def test_backend_calls_the_core_ops():
    found = {call.op for call in BACKEND_CALLS}
    assert CORE_OPS <= found, f"the backend calls no {sorted(CORE_OPS - found)}; found {sorted(found)}"


def test_every_backend_call_names_a_real_op_and_binds(npu_schemas):
    calls, problems = check.check_tree(check.BACKEND_DIR, npu_schemas)
    assert calls, f"no torch_npu op calls found under {check.BACKEND_DIR}"
    assert not problems, "torch_npu calls that do not match the wheel's schemas:\n" + "\n".join(problems)


@pytest.mark.parametrize("call", BACKEND_CALLS, ids=_call_id)
def test_a_misspelled_op_fails(call, npu_schemas, tmp_path):
    typo = _swap_last_letters(call.op.rstrip("_")) + "_" * call.op.endswith("_")
    assert typo not in npu_schemas

    def misspell(node):
        node.func.attr = typo

    problems = _check_mutated(call, misspell, tmp_path, npu_schemas)
    assert len(problems) == 1 and f"{typo} is not an op" in problems[0] and call.op in problems[0], problems


@pytest.mark.parametrize("call", [call for call in BACKEND_CALLS if _has_keyword(call)], ids=_call_id)
def test_a_misspelled_keyword_fails(call, npu_schemas, tmp_path):
    def misspell(node):
        keyword = next(kw for kw in node.keywords if kw.arg)
        misspell.original, keyword.arg = keyword.arg, _swap_last_letters(keyword.arg)

    problems = _check_mutated(call, misspell, tmp_path, npu_schemas)
    typo = _swap_last_letters(misspell.original)
    assert len(problems) == 1 and f"has no argument {typo!r}" in problems[0], problems


@pytest.mark.parametrize("call", BACKEND_CALLS, ids=_call_id)
def test_a_dropped_required_argument_fails(call, npu_schemas, tmp_path):
    positional = npu_schemas[call.op].arguments.flat_positional[: call.num_positional]
    required = [i for i, param in enumerate(positional) if param.default is None]
    if call.has_star_args or not required:
        pytest.skip("no required positional argument written out at this call")
    dropped = positional[required[-1]].name  # drop it and every positional argument after it: nothing shifts

    def drop(node):
        node.args = node.args[: required[-1]]

    problems = _check_mutated(call, drop, tmp_path, npu_schemas)
    assert len(problems) == 1 and "requires" in problems[0] and dropped in problems[0], problems


@pytest.mark.parametrize("call", BACKEND_CALLS, ids=_call_id)
def test_an_extra_positional_argument_fails(call, npu_schemas, tmp_path):
    most = max(len(schema.arguments.flat_positional) for schema in _overloads(npu_schemas, call.op))

    def add(node):
        node.args += [ast.Name(f"extra_{i}") for i in range(most + 1 - call.num_positional)]

    problems = _check_mutated(call, add, tmp_path, npu_schemas)
    assert any("positional arguments" in p and f"got {most + 1}" in p for p in problems), problems
