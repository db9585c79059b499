"""DeepInfer's conformance suite: a pytest plugin that checks a backend against the reference backend.

Enable it in a backend's repository with one line in conftest.py:
    pytest_plugins = ["deepinfer_conformance.plugin"]
then run `pytest --deepinfer-backend=NAME` (or `deepinfer conformance --backend NAME --report FILE`).
The JSON report follows REPORT_SCHEMA (generated from deepinfer_conformance.report.ConformanceReport).
"""

from pathlib import Path

CASES_DIR = Path(__file__).parent / "cases"
REPORT_FORMAT = "deepinfer-conformance/2"  # /2: coverage, per-case skip kinds, metrics apart, probe facts nested
REPORT_SCHEMA = Path(__file__).parent / "report.schema.json"
