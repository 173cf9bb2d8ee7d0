"""The agent's stdout merged into its log, and its report read from the last line."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kandevd.runtime.agentfiles import _TAIL, merge_stdout
from kandevd.runtime.output import NO_REPORT, AgentReport, LogSink, open_attempt

REPORT = {"summary": "done", "cost_cents": 3}


def merged(tmp_path: Path, stdout: bytes) -> tuple[AgentReport, bytes]:
    out = tmp_path / "stdout"
    out.write_bytes(stdout)
    sink = LogSink.open(tmp_path / "run.log")
    fd = os.open(out, os.O_RDONLY)
    try:
        report = merge_stdout(fd, sink)
    finally:
        os.close(fd)
        sink.close()
    return report, (tmp_path / "run.log").read_bytes()


def test_the_report_is_the_last_line_and_the_whole_stdout_joins_the_log(
        tmp_path: Path) -> None:
    stdout = b"working\n" + json.dumps(REPORT).encode() + b"\n\n"
    report, log = merged(tmp_path, stdout)
    assert report == AgentReport("done", 3.0)
    assert log == stdout


def test_a_stdout_with_no_last_newline_ends_its_line_in_the_log(tmp_path: Path) -> None:
    """The attempt's end written after it starts a line of its own (``grep '^\\[kandevd'``
    finds it); the report is read as before."""
    stdout = b"working\n" + json.dumps(REPORT).encode()
    report, log = merged(tmp_path, stdout)
    assert report == AgentReport("done", 3.0)
    assert log == stdout + b"\n"


def test_a_last_line_that_fills_the_window_exactly_is_read(tmp_path: Path) -> None:
    line = json.dumps({**REPORT, "pad": "x" * (_TAIL - 60)}).encode()
    line = json.dumps({**REPORT, "pad": "x" * (_TAIL - 60 - (len(line) - _TAIL))}).encode()
    assert len(line) == _TAIL
    report, _log = merged(tmp_path, b"before\n" + line)
    assert report == AgentReport("done", 3.0)


def test_a_last_line_over_the_window_is_said_not_read(tmp_path: Path) -> None:
    """Its end alone would parse as nothing (or as something it is not): not read, and
    the log says so after the stdout."""
    line = json.dumps({**REPORT, "pad": "x" * _TAIL}).encode()
    report, log = merged(tmp_path, b"before\n" + line)
    assert report == NO_REPORT
    assert log.startswith(b"before\n" + line + b"\n")
    assert log.endswith(b"no summary or cost was read from it\n")


def test_the_attempt_a_log_left_open_is_found(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    assert open_attempt(log) is None  # (no log)
    log.write_text("[kandevd] ==== attempt 1 started 2026-01-01T00:00:00Z ====\nout\n")
    assert open_attempt(log) == 1
    with log.open("a") as handle:
        handle.write("[kandevd] ==== attempt 1 ended 2026-01-01T00:00:01Z: failed ====\n"
                     "[kandevd] ==== attempt 2 started 2026-01-01T00:00:02Z ====\n"
                     "an agent's line: [kandevd] ==== attempt 9 started (not a frame)\n")
    assert open_attempt(log) == 2
    with log.open("a") as handle:
        handle.write("[kandevd] ==== attempt 2 ended 2026-01-01T00:00:03Z: succeeded ====\n")
    assert open_attempt(log) is None


def test_a_collected_stdout_with_no_last_newline_ends_its_line_once(tmp_path: Path) -> None:
    """The other merge (an execution adopted or recovered after a restart) ends the line
    too, and a merge run again after a crash does not add it twice."""
    from kandevd.runtime.output import collect_stdout

    stdout, log, state = tmp_path / "stdout", tmp_path / "run.log", tmp_path / "summary.json"
    body = b"working\n" + json.dumps(REPORT).encode()
    stdout.write_bytes(body)
    log.write_bytes(b"[kandevd] ==== attempt 1 started ====\n")
    assert collect_stdout(stdout, log, state, keep_as=tmp_path / "kept") == \
        AgentReport("done", 3.0)
    assert log.read_bytes().endswith(body + b"\n")
    stdout.write_bytes(body)  # (as if the crash came before the stdout file was spent)
    collect_stdout(stdout, log, state, keep_as=tmp_path / "kept")
    assert log.read_bytes().count(body) == 1
