"""`deepinfer conformance`: run the conformance suite against one backend, write its report, and end with
one line saying on how much of the suite the verdict rests."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from urllib.parse import unquote

from deepinfer_core.backend.registry import discover
from deepinfer_core.backend.selection import ENV_VAR, requested_accelerator, select_backend
from deepinfer_core.errors import DeepInferError

__all__ = ["add_parser"]


def _distribution():
    try:
        return importlib.metadata.distribution("deepinfer")
    except importlib.metadata.PackageNotFoundError:
        return None


def _install_conformance_extra() -> str:
    """The exact command installing deepinfer's `conformance` extra for this Python and this install."""
    where = json.loads((_distribution() and _distribution().read_text("direct_url.json")) or "{}")
    url = where.get("url", "")
    if url.startswith("file://"):  # installed from a source checkout (editable or not)
        editable = "-e " if where.get("dir_info", {}).get("editable") else ""
        return f"{sys.executable} -m pip install {editable}'{unquote(url.removeprefix('file://'))}[conformance]'"
    return f"{sys.executable} -m pip install 'deepinfer[conformance]'"


def _missing(err: ImportError) -> DeepInferError:
    if err.name != "pytest":  # the suite ships in the deepinfer distribution itself
        return DeepInferError(f"the conformance suite cannot be imported ({err}): reinstall deepinfer")
    dist = _distribution()
    needs = [r.split(";")[0].strip() for r in (dist and dist.requires) or [] if 'extra == "conformance"' in r]
    return DeepInferError(
        f"`deepinfer conformance` runs the suite under pytest, which this Python ({sys.executable}) cannot import "
        f"({err}). Install deepinfer's conformance extra ({', '.join(needs) or 'pytest'}):\n"
        f"    {_install_conformance_extra()}"
    )


def _cmd_conformance(args: argparse.Namespace) -> int:
    try:
        import pytest

        from deepinfer_conformance import CASES_DIR
        from deepinfer_conformance.report import verdict
    except ImportError as err:
        raise _missing(err) from None

    backend = requested_accelerator(args.backend)
    select_backend(discover(), args.backend, source="--backend")  # an unknown/unavailable backend: clean error
    report = args.report or f"conformance-report-{backend}.json"
    argv = [
        str(CASES_DIR),
        "-p",
        "deepinfer_conformance.plugin",
        "-p",
        "no:cacheprovider",
        f"--deepinfer-backend={backend}",
        f"--deepinfer-report={report}",
        "-q",
        "-rN",
    ]
    if args.k:
        argv += ["-k", args.k]
    extra = list(args.pytest_args)
    if extra[:1] == ["--"]:  # argparse keeps the separator in a REMAINDER list
        extra = extra[1:]
    outcome = _Outcome()
    code = int(pytest.main(argv + extra, plugins=[outcome]))
    if outcome.report is not None:  # after pytest's own last line, where people look
        print(f"\ndeepinfer conformance: {verdict(outcome.report)}")
    return code


class _Outcome:
    """Keeps the run's report (built by the conformance plugin) for the closing line."""

    report = None

    def pytest_unconfigure(self, config) -> None:
        collector = config.pluginmanager.get_plugin("deepinfer-conformance-collector")
        self.report = getattr(collector, "report", None)


def add_parser(commands) -> None:
    p = commands.add_parser("conformance", help="check a backend against the reference backend; writes a JSON report")
    p.add_argument("--backend", default=None, help=f"backend name, alias or 'auto' (default: ${ENV_VAR} or auto)")
    p.add_argument("--report", default=None, help="JSON report path (default: conformance-report-<backend>.json)")
    p.add_argument("-k", default=None, help="only cases matching this pytest -k expression")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER, help="further pytest arguments, after --")
    p.set_defaults(run=_cmd_conformance)
