"""configure_logging's handler writes to the stderr of the moment: a stream swapped in and closed after set-up (as
pytest's capture does between tests) neither breaks later records nor receives them."""

from __future__ import annotations

import io
import logging
import sys

from deepinfer_core.cli.logging_setup import configure_logging


def test_records_go_to_the_current_stderr_after_the_set_up_stream_closed(monkeypatch):
    root = logging.getLogger()
    ours = [logging.getLogger(name) for name in ("deepinfer", "deepinfer_core", "deepinfer_conformance")]
    before = list(root.handlers), root.level, [logger.level for logger in ours]
    first, second = io.StringIO(), io.StringIO()
    try:
        monkeypatch.setattr(sys, "stderr", first)
        configure_logging(logging.INFO)
        first.close()  # the set-up stream goes away
        monkeypatch.setattr(sys, "stderr", second)
        logging.getLogger("deepinfer_core.model.loader").info("weights read")
        assert second.getvalue() == "deepinfer: weights read\n"
    finally:
        root.handlers[:] = before[0]
        root.setLevel(before[1])
        for logger, level in zip(ours, before[2]):
            logger.setLevel(level)
