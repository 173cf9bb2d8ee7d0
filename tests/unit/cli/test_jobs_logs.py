"""``kandevd jobs logs`` prints only logs inside the home's logs folder: a history entry
(a file in the workflow's folder, which agents can write) cannot make it print any
file the operator can read."""

from __future__ import annotations

from pathlib import Path

import pytest

from kandevd.cli.jobs_logs import _TurnPrinter


def test_a_turn_log_outside_the_logs_folder_is_named_not_printed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logs = tmp_path / "home" / "logs"
    (logs / "sessions").mkdir(parents=True)
    inside = logs / "sessions" / "t1.log"
    inside.write_text("the turn's own words\n")
    secret = tmp_path / "secret.txt"
    secret.write_text("not for this command\n")
    (logs / "sessions" / "link.log").symlink_to(secret)  # (inside by name only)
    entry = {"turns": [
        {"kind": "message", "status": "success", "log_path": str(inside)},
        {"kind": "message", "status": "success", "log_path": str(secret)},
        {"kind": "message", "status": "success", "log_path": str(logs / "sessions" / "link.log")},
        {"kind": "message", "status": "success", "log_path": str(logs / ".." / "x\x1b[2J.log")},
    ]}
    printer = _TurnPrinter(logs)
    printer.show(entry)
    printer.show(entry)  # (followed: each refusal said once)
    out, err = capsys.readouterr()
    assert "the turn's own words" in out
    assert "not for this command" not in out
    assert [line.split(":")[1].strip() for line in err.splitlines()] == [
        "the log of turn 2 is not shown", "the log of turn 3 is not shown",
        "the log of turn 4 is not shown"]
    assert "\x1b" not in err and f"outside {logs}" in err
