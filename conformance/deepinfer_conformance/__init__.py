"""DeepInfer's conformance suite: a pytest plugin that checks a backend against the reference backend.

Installing deepinfer registers the plugin with pytest (a `pytest11` entry point; it stays inert until
`--deepinfer-backend` is given), so in any repository `pytest --deepinfer-backend=NAME` runs the suite
(with plugin autoloading off: `-p deepinfer_conformance.plugin`), as does
`deepinfer conformance --backend NAME --report FILE`.
The JSON report follows REPORT_SCHEMA (generated from deepinfer_conformance.report.ConformanceReport).
"""

from pathlib import Path

CASES_DIR = Path(__file__).parent / "cases"
REPORT_FORMAT = "deepinfer-conformance/2"  # /2: coverage, per-case skip kinds, metrics apart, probe facts nested
REPORT_SCHEMA = Path(__file__).parent / "report.schema.json"
