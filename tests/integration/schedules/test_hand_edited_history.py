"""A history entry edited by hand with values of the wrong types: the daemon answers it
with those fields null, so `kandevd jobs runs` and the console's job and run pages show
it instead of a traceback or an internal error. The file is left as it was."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.console import console_config, console_of, request, sign_in
from tests.support.daemon import DaemonProcess, run_cli
from tests.support.workflows import schedule, write_workflow

pytestmark = pytest.mark.integration

ODD = {"id": "odd", "schedule_id": "s", "status": None, "started_at": 5,
       "completed_at": [1], "turns": "x", "duration_ms": "long", "cost_cents": "free",
       "error": {"a": 1}, "trigger_source": 7, "group_ids": "g1", "session_id": "odd"}
ODD_TURNS = {**ODD, "id": "odd2", "session_id": "odd2", "status": "error",
             "started_at": "2026-12-07T09:00:00Z",
             "turns": [3, {"index": "one", "kind": "message", "status": "error",
                           "started_at": 9, "duration_ms": "x", "exit_code": "3",
                           "log_path": ["/etc/passwd"], "error": 4},
                       {"index": 1, "kind": "message", "status": "success",
                        "started_at": "2026-12-07T09:00:01Z", "duration_ms": 1e300}]}


def test_a_hand_edited_entry_is_shown_not_a_traceback(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    home = tmp_path / "home"
    folder = write_workflow(home / "workspace", "w", [schedule("s", "0 3 * * *")])
    history = folder / "schedule-runs.json"
    history.write_text(json.dumps([ODD_TURNS, ODD]))
    kept = history.read_bytes()
    daemon = daemon_factory(console_config(tmp_path / "record.jsonl"), home=home)

    answer = daemon.call("scheduler.jobs.runs", {"id": "workflow:w:s"})
    shown = {item["id"]: item for item in answer["items"]}
    assert shown["odd"]["started_at"] is None and shown["odd"]["duration_ms"] is None
    assert shown["odd"]["turns"] is None and shown["odd"]["error"] is None
    assert shown["odd"]["group_ids"] is None and shown["odd"]["trigger_source"] is None
    turn, huge = shown["odd2"]["turns"]  # (the turn that is no object is left out)
    assert huge["duration_ms"] is None  # (no timedelta holds it)
    assert (turn["index"], turn["started_at"], turn["duration_ms"], turn["exit_code"],
            turn["log_path"], turn["error"]) == (None,) * 6
    assert turn["kind"] == "message"

    listed = run_cli(home, "jobs", "runs", "workflow:w:s")
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
    assert "odd2" in listed.stdout and "2 of 2 run(s)" in listed.stdout
    logs = run_cli(home, "jobs", "logs", "workflow:w:s", "odd2")
    assert "Traceback" not in logs.stderr, logs.stderr

    address = console_of(daemon)
    cookie = sign_in(address)
    for path in ("/schedules/workflow:w:s", "/schedules/workflow:w:s/runs/odd2",
                 "/schedules/workflow:w:s/runs/odd"):
        page = request(address, "GET", path, cookie=cookie)
        assert page.status == 200, (path, page.status, page.body[:500])
        assert ">None<" not in page.body and "None<br>" not in page.body, path
    assert history.read_bytes() == kept
