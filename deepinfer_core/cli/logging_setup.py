"""DeepInfer's log lines on stderr, at the level --log-level or $DEEPINFER_LOGGING_LEVEL names (as vLLM's
VLLM_LOGGING_LEVEL), INFO by default. Other libraries' loggers show warnings and errors only."""

from __future__ import annotations

import logging
import os
import sys

from deepinfer_core.errors import DeepInferError

__all__ = ["LEVELS", "LOGGING_ENV_VAR", "configure_logging", "resolve_level"]

LOGGING_ENV_VAR = "DEEPINFER_LOGGING_LEVEL"
LEVELS = ("debug", "info", "warning", "error", "critical")
_OURS = ("deepinfer", "deepinfer_core", "deepinfer_conformance")  # logger names of this distribution


class _Formatter(logging.Formatter):
    """`deepinfer: message` for info, `deepinfer: warning: message` (and error, debug) otherwise."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.levelno == logging.INFO:
            return f"deepinfer: {text}"
        return f"deepinfer: {record.levelname.lower()}: {text}"


def resolve_level(flag: str | None) -> int:
    """The level --log-level names, else the one $DEEPINFER_LOGGING_LEVEL names, else INFO."""
    if flag is not None:
        return getattr(logging, flag.upper())
    value = os.environ.get(LOGGING_ENV_VAR, "").strip()
    if not value:
        return logging.INFO
    if value.lower() not in LEVELS:
        raise DeepInferError(f"${LOGGING_ENV_VAR}={value!r} is not a log level; set it to one of {', '.join(LEVELS)}")
    return getattr(logging, value.upper())


class _StderrHandler(logging.StreamHandler):
    """A StreamHandler on whatever sys.stderr is when a record comes, not the one it was made with: a caller that
    swaps stderr (a test's capture, a redirect) and closes its stream later does not leave a handler writing to a
    closed file."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:  # StreamHandler.__init__ / setStream assign it
        pass


def configure_logging(level: int) -> None:
    """Route DeepInfer's loggers to stderr at `level`; the root logger at WARNING or above. Idempotent."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, "_deepinfer", False)]:
        root.removeHandler(handler)
    handler = _StderrHandler()
    handler.setFormatter(_Formatter("%(message)s"))
    handler._deepinfer = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(max(level, logging.WARNING))
    for name in _OURS:
        logging.getLogger(name).setLevel(level)
