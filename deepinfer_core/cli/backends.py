"""`deepinfer backends`: list installed backends, or show which one would be selected."""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import textwrap

from deepinfer_core import __version__
from deepinfer_core.backend.hookspecs import API_VERSION
from deepinfer_core.backend.registry import BackendEntry, Discovery, discover
from deepinfer_core.backend.selection import ENV_VAR, accelerator_source, requested_accelerator, select_backend

__all__ = ["add_parser"]


def _backend_row(backend: BackendEntry) -> dict:
    return {
        "name": backend.name,
        "aliases": list(backend.info.aliases),
        "distribution": backend.origin.distribution,
        "version": backend.origin.version,
        "entry_point": backend.origin.target,
        "available": backend.available,
        "reason": backend.reason,
        "probe_facts": dict(backend.probe.facts),
        "missing_hooks": list(backend.missing_hooks),
        "priority": backend.info.priority,
        "device_kind": backend.info.device_kind,
        "description": backend.info.description,
        "capabilities": backend.capabilities.as_dict(),
    }


def _report(discovery: Discovery) -> dict:
    return {
        "deepinfer_version": __version__,
        "contract_api_version": API_VERSION,
        "python": platform.python_version(),
        "backends": [_backend_row(b) for b in discovery.backends],
        "plugins": [{"name": p.name, "distribution": p.distribution, "version": p.version} for p in discovery.plugins],
        "broken": [
            {
                "group": p.origin.group,
                "name": p.origin.name,
                "distribution": p.origin.distribution,
                "version": p.origin.version,
                "error": p.error,
                "traceback": p.traceback,
            }
            for p in discovery.broken
        ],
    }


def _capability_summary(backend: BackendEntry) -> str:
    caps = backend.capabilities
    flags = [
        f
        for f, on in (
            ("batch-invariant", caps.batch_invariant),
            ("graph-capture", caps.graph_capture),
            ("async-sched", caps.async_scheduling),
        )
        if on
    ]
    return ",".join(list(caps.dtypes) + flags)


def _print_table(discovery: Discovery, verbose: bool) -> None:
    rows = [("BACKEND", "DISTRIBUTION", "PRIORITY", "STATUS", "CAPABILITIES")]
    reasons = [""]
    for b in discovery.backends:
        name = b.name + (f" ({', '.join(b.info.aliases)})" if b.info.aliases else "")
        rows.append(
            (
                name,
                f"{b.origin.distribution} {b.origin.version}",
                str(b.info.priority),
                "available" if b.available else "unavailable",
                _capability_summary(b),
            )
        )
        reasons.append(b.reason)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    width = max(80, shutil.get_terminal_size((120, 24)).columns)
    for row, reason in zip(rows, reasons):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        for line in reason.splitlines():  # whole, on its own lines, wrapped (never cut)
            print(
                "\n".join(
                    textwrap.wrap(
                        line, width, initial_indent="    ", subsequent_indent="      ", break_on_hyphens=False
                    )
                )
            )
    if discovery.plugins:
        print("\nplugins: " + ", ".join(f"{p.name} ({p.distribution} {p.version})" for p in discovery.plugins))
    if discovery.broken:
        print("\nbroken plugins (not loaded; everything else works):")
        for p in discovery.broken:
            print(f"  [{p.origin.group}] {p.origin.name} ({p.origin.distribution} {p.origin.version}): {p.error}")
            if verbose and p.traceback:
                print("    " + p.traceback.rstrip().replace("\n", "\n    "))


def _cmd_backends(args: argparse.Namespace) -> int:
    discovery = discover()
    if args.select:
        backend = select_backend(discovery, args.accelerator)
        how, origin = requested_accelerator(args.accelerator), accelerator_source(args.accelerator)
        if args.json:
            print(json.dumps({"requested": how, "source": origin, "selected": _backend_row(backend)}, indent=2))
        else:
            print(f"{backend.name}  (requested {how!r} by {origin}; {backend.reason or 'available'})")
        return 0
    if args.json:
        print(json.dumps(_report(discovery), indent=2))
    else:
        _print_table(discovery, args.verbose)
    return 0


def add_parser(commands) -> None:
    backends = commands.add_parser("backends", help="list installed backends, or show which one would be selected")
    backends.add_argument("--json", action="store_true", help="machine-readable output")
    backends.add_argument(
        "--select",
        action="store_true",
        help=f"print the backend that --accelerator / ${ENV_VAR} selects, or fail with the reason",
    )
    backends.add_argument(
        "--accelerator", default=None, help=f"backend name, alias or 'auto' (default: ${ENV_VAR} or auto)"
    )
    backends.add_argument("-v", "--verbose", action="store_true", help="show tracebacks of broken plugins")
    backends.set_defaults(run=_cmd_backends)
