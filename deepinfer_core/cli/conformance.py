"""`deepinfer conformance`: run the conformance suite against one backend and write its report."""

from __future__ import annotations

import argparse

from deepinfer_core.backend.registry import discover
from deepinfer_core.backend.selection import ENV_VAR, requested_accelerator, select_backend
from deepinfer_core.errors import DeepInferError

__all__ = ["add_parser"]


def _cmd_conformance(args: argparse.Namespace) -> int:
    try:
        import pytest

        from deepinfer_conformance import CASES_DIR
    except ImportError as err:
        raise DeepInferError(
            f"the conformance suite needs pytest ({err}): pip install 'deepinfer[conformance]'"
        ) from None
    backend = requested_accelerator(args.backend)
    select_backend(discover(), backend)  # an unknown or unavailable backend is a clean error, before pytest
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
    return int(pytest.main(argv + extra))


def add_parser(commands) -> None:
    p = commands.add_parser("conformance", help="check a backend against the reference backend; writes a JSON report")
    p.add_argument("--backend", default=None, help=f"backend name, alias or 'auto' (default: ${ENV_VAR} or auto)")
    p.add_argument("--report", default=None, help="JSON report path (default: conformance-report-<backend>.json)")
    p.add_argument("-k", default=None, help="only cases matching this pytest -k expression")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER, help="further pytest arguments, after --")
    p.set_defaults(run=_cmd_conformance)
