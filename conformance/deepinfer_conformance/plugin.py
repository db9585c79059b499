"""The pytest plugin: options, the session's backends, per-case results, the JSON report and table.

Inert unless --deepinfer-backend is given. Then the suite's cases are collected (in place of the
project's default test paths), every case compares the named backend with the reference backend
`cpu`, and at the end a versioned JSON report and a readable table are written.
"""

from __future__ import annotations

import os
import time

import pytest

from deepinfer_conformance import CASES_DIR
from deepinfer_conformance.harness import CapabilitySkip, Check, Suite
from deepinfer_conformance.report import CaseReport, Skip, build_report, case_report, format_table, write_report

REFERENCE = "cpu"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("deepinfer", "DeepInfer backend conformance")
    group.addoption(
        "--deepinfer-backend",
        default=None,
        help="backend to check against the reference (name, alias or auto; default: off)",
    )
    group.addoption("--deepinfer-report", default=None, help="write the JSON report here")


def pytest_configure(config: pytest.Config) -> None:
    name = config.getoption("deepinfer_backend")
    if not name:
        return
    from deepinfer_core.backend.registry import discover
    from deepinfer_core.backend.selection import select_backend
    from deepinfer_core.errors import DeepInferError

    discovery = discover()
    try:
        under_test = select_backend(discovery, name, source="--deepinfer-backend")
        suite = Suite(under_test, select_backend(discovery, REFERENCE))
    except DeepInferError as err:
        raise pytest.UsageError(f"deepinfer conformance: {err}") from None
    if config.args_source != pytest.Config.ArgsSource.ARGS:  # no explicit paths: run the suite itself
        config.args[:] = [str(CASES_DIR)]
    config.pluginmanager.register(_Collector(config, suite), "deepinfer-conformance-collector")


@pytest.fixture(scope="session")
def suite(request: pytest.FixtureRequest) -> Suite:
    collector = request.config.pluginmanager.get_plugin("deepinfer-conformance-collector")
    if collector is None:
        pytest.skip("conformance cases run only with --deepinfer-backend=NAME")
    return collector.suite


@pytest.fixture
def check(request: pytest.FixtureRequest) -> Check:
    return Check(request.node)


class _Collector:
    """Gathers every case's outcome and measurements; writes the report when the session ends."""

    def __init__(self, config: pytest.Config, suite: Suite) -> None:
        self.config, self.suite = config, suite
        self.results: dict[str, CaseReport] = {}
        self.deselected = 0
        self.started = time.time()
        self.report = None  # the ConformanceReport, once the session ends

    def pytest_deselected(self, items) -> None:
        self.deselected += len(items)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call):
        report = yield
        if report.when == "call" or report.outcome != "passed":
            self._record(item, report, call.excinfo)
        return report

    def _record(self, item: pytest.Item, report: pytest.TestReport, excinfo) -> None:
        measured = next((fields for key, fields in item.user_properties if key == "deepinfer"), {})
        skip = None
        if report.skipped:
            status, reason, skip = "skipped", _skip_reason(report, excinfo), _skip_kind(excinfo)
        elif report.failed:
            status = "failed" if report.when == "call" else "error"
            reason = _failure_message(report)
        else:
            status, reason = "passed", ""
        case = item.nodeid.split("::", 1)[-1]
        module = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py").removeprefix("test_")
        self.results[item.nodeid] = case_report(f"{module}::{case}", status, reason, measured, report.duration, skip)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.results:
            return
        selection = " and ".join(filter(None, (self.config.option.keyword, self.config.option.markexpr)))
        self.report = report = build_report(
            self.suite.under_test,
            list(self.results.values()),
            time.time() - self.started,
            self.deselected,
            selection,
            reference=self.suite.reference.name,
        )
        terminalreporter.section("deepinfer conformance")
        terminalreporter.write_line(format_table(report))
        path = self.config.getoption("deepinfer_report")
        if path:
            write_report(report, path)
            terminalreporter.write_line(f"report written to {os.path.abspath(path)}")


def _skip_reason(report: pytest.TestReport, excinfo) -> str:
    if excinfo is not None and isinstance(excinfo.value, pytest.skip.Exception):
        return str(excinfo.value.msg)
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _skip_kind(excinfo) -> Skip:
    """A skip raised by Suite.require* names the capability the backend lacks; any other is environmental."""
    if excinfo is not None and isinstance(excinfo.value, CapabilitySkip):
        return Skip(kind="capability", capability=excinfo.value.capability)
    return Skip(kind="environment")


def _failure_message(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    message = crash.message if crash is not None else str(report.longrepr)
    return message.strip()[:2000]
