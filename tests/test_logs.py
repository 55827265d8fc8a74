"""The programs log to standard error as it is when a line is written (neurons.logs)."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
from loguru import logger

from neurons.reference.calibrate import main as calibrate_main


def test_a_program_run_in_process_logs_to_the_stderr_of_the_moment(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    """A program's ``main`` run inside another process (as the tests run them) set its log on the stream captured at
    that moment; once that stream was closed, every later line failed inside loguru ("I/O operation on closed file",
    a traceback a line in CI's log). Now a line goes to the stream of its own moment."""
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    rc = calibrate_main(["--miner", "http://127.0.0.1:1", "--dev-key", "Alice", "--out", str(tmp_path / "b.json")])
    assert rc == 2 and "127.0.0.1:1" in first.getvalue()  # the one line saying why (no miner there)
    first.close()
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    logger.info("after the first stream closed")
    assert "after the first stream closed" in second.getvalue()
    assert "Logging error" not in second.getvalue()
