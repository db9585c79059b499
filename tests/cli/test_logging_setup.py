"""configure_logging's handler writes to the stderr of the moment: a stream swapped in and closed after set-up (as
pytest's capture does between tests) neither breaks later records nor receives them. (tests/conftest.py puts the
logging set-up back after the test.)"""

from __future__ import annotations

import io
import logging
import sys

from deepinfer_core.cli.logging_setup import configure_logging


def test_records_go_to_the_current_stderr_after_the_set_up_stream_closed(monkeypatch):
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    configure_logging(logging.INFO)
    first.close()  # the set-up stream goes away
    monkeypatch.setattr(sys, "stderr", second)
    logging.getLogger("deepinfer_core.model.loader").info("weights read")
    assert second.getvalue() == "deepinfer: weights read\n"
