"""Fixtures for the static torch_npu schema check (backends/ascend950/tools/npu_schema_check.py).

The tool is a script beside the backend, not part of its distribution, so its folder goes on sys.path here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "backends" / "ascend950" / "tools"))

import npu_schema_check  # noqa: E402


@pytest.fixture(scope="session")
def npu_schemas():
    """torch_npu's op schemas for the installed torch's version, from the cache ($DEEPINFER_CACHE or
    ~/.cache/deepinfer) or downloaded once; a skip naming pip's reason when the wheel cannot be had."""
    try:
        yaml_path = npu_schema_check.fetch_schemas(npu_schema_check.torch_release())
    except npu_schema_check.SchemasUnavailable as err:
        pytest.skip(f"static torch_npu schema check NOT run: {err.reason}")
    return npu_schema_check.load_schemas(yaml_path)
