"""Selection: turn DEEPINFER_ACCELERATOR / --accelerator (a name, an alias or `auto`) into a backend; its
errors name where the value came from (the flag, the variable or the default)."""

from __future__ import annotations

import os
import sys

from deepinfer_core.backend.registry import BackendEntry, Discovery
from deepinfer_core.errors import BackendSelectionError

__all__ = ["ENV_VAR", "accelerator_source", "requested_accelerator", "select_backend"]

ENV_VAR = "DEEPINFER_ACCELERATOR"


def requested_accelerator(explicit: str | None = None) -> str:
    """The accelerator asked for: the explicit value, else $DEEPINFER_ACCELERATOR, else `auto`."""
    value = explicit if explicit is not None else os.environ.get(ENV_VAR, "")
    return value.strip().lower().replace("-", "_") or "auto"


def accelerator_source(explicit: str | None = None, source: str = "--accelerator") -> str:
    """Where requested_accelerator(explicit) came from, for messages: `source` (the flag or argument that
    carried an explicit value), `$DEEPINFER_ACCELERATOR=<value>`, or the default."""
    if explicit is not None:
        return source
    if os.environ.get(ENV_VAR, "").strip():
        return f"${ENV_VAR}={os.environ[ENV_VAR].strip()}"
    return "the default"


def _describe(discovery: Discovery) -> str:
    lines = []
    for b in discovery.backends:
        aliases = f" (alias {', '.join(b.info.aliases)})" if b.info.aliases else ""
        state = "available" if b.available else f"unavailable: {b.reason}"
        lines.append(f"  {b.name}{aliases}: {state}")
    for p in discovery.broken:
        if p.origin.group.endswith("backends"):
            lines.append(f"  {p.origin.name}: failed to load: {p.error}")
    return "\n".join(lines) or "  (no backends installed; reinstall the `deepinfer` distribution)"


def _find(discovery: Discovery, name: str) -> BackendEntry | None:
    for backend in discovery.backends:
        if name == backend.name or name in backend.info.aliases:
            return backend
    return None


def select_backend(
    discovery: Discovery, requested: str | None = None, *, source: str = "--accelerator"
) -> BackendEntry:
    """The backend to run on, or a BackendSelectionError saying why none fits and what is installed.

    requested: a name, alias or `auto`; None reads $DEEPINFER_ACCELERATOR (default `auto`).
    source: the flag or argument an explicit `requested` came from, named in errors (e.g. "--backend");
    when `requested` is None the errors name $DEEPINFER_ACCELERATOR instead.
    """
    name = requested_accelerator(requested)
    origin = accelerator_source(requested, source)
    if name == "auto":
        for backend in discovery.backends:  # already ordered by priority, highest first
            if backend.available:
                return backend
        raise BackendSelectionError(
            f"no available backend for `auto` (from {origin}). Installed backends:\n{_describe(discovery)}"
        )
    backend = _find(discovery, name)
    if backend is None:
        broken = [p for p in discovery.broken if p.origin.name == name]
        if broken:
            raise BackendSelectionError(f"backend {name!r} is installed but failed to load: {broken[0].error}")
        fix = (
            f"Set {ENV_VAR} to one of these names or `auto`, or unset it"
            if requested is None
            else f"Pass one of these names or `auto` to {source}"
        )
        raise BackendSelectionError(
            f"unknown backend {name!r} (from {origin}). Installed backends:\n{_describe(discovery)}\n"
            f"{fix}. A third-party backend must be pip-installed into this Python ({sys.executable})."
        )
    if not backend.available:
        others = [b.name for b in discovery.backends if b.available]
        hint = f"Available here: {', '.join(others)}." if others else "No backend is available here."
        raise BackendSelectionError(
            f"backend {backend.name} is not available: {backend.reason}. {hint} It was asked for by {origin}."
        )
    return backend
