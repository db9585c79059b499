"""deepinfer_core must never import a vendor library nor branch on a vendor (DESIGN.md §2).

The check reads the code (comments and docstrings excluded) for vendor module imports and for vendor
words in names and string literals; the negative controls prove it catches what it is meant to.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import deepinfer_core

CORE = Path(deepinfer_core.__file__).parent
VENDOR_MODULES = {"triton", "torch_npu", "pynvml", "cuda", "cupy", "deep_ep", "deep_gemm", "flash_mla", "acl", "tbe"}
# a vendor word not inside a longer word ("torch_npu", "is_cuda" match; "cannot" does not)
VENDOR_WORDS = re.compile(
    r"(?<![a-z])(cuda|npu|nvidia|ascend|triton|hccl|nccl|cann|rocm|hip|mlu|musa|xpu)(?![a-z])", re.IGNORECASE
)


def _docstring_nodes(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def vendor_references(source: str) -> list[str]:
    """Every vendor import, vendor-named identifier or vendor string literal in `source`'s code."""
    tree = ast.parse(source)
    docstrings = _docstring_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in VENDOR_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in VENDOR_MODULES:
            found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Name) and VENDOR_WORDS.search(node.id):
            found.append(f"name {node.id}")
        elif isinstance(node, ast.Attribute) and VENDOR_WORDS.search(node.attr):
            found.append(f"attribute .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if VENDOR_WORDS.search(node.value):
                found.append(f"string {node.value!r}")
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and VENDOR_WORDS.search(node.name):
            found.append(f"definition {node.name}")
    return found


def test_core_has_no_vendor_imports_or_branches():
    offenders = {}
    for path in sorted(CORE.rglob("*.py")):
        refs = vendor_references(path.read_text())
        if refs:
            offenders[str(path.relative_to(CORE))] = refs
    assert not offenders, f"vendor references in deepinfer_core: {offenders}"


def test_the_check_catches_vendor_code():
    assert vendor_references("import triton") == ["import triton"]
    assert vendor_references("from torch_npu.contrib import x") == ["from torch_npu.contrib import ..."]
    assert "attribute .cuda" in vendor_references("import torch\nif torch.cuda.is_available():\n    pass\n")
    assert "attribute .is_npu" in vendor_references("ok = x.is_npu")
    assert "string 'nccl'" in vendor_references("backend = 'nccl' if fast else 'gloo'")
    assert "definition forward_cuda" in vendor_references("def forward_cuda(self):\n    return 1\n")
    assert vendor_references("message = 'cannot split'") == []


def test_the_check_ignores_prose():
    source = '"""Runs over NCCL or HCCL."""\n# a CUDA graph is a device graph\ndef f():\n    """Ascend too."""\n'
    assert vendor_references(source) == []
