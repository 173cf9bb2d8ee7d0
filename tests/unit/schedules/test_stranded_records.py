"""What a dead daemon's turns left, at start: the run a history entry stands for ends as
its turns' records say (turns the file never had brought back from them), and records no
entry leads to are swept (their output merged into the log their record names, the
folder removed); live turns' records are left alone."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from kandevd.runtime import attempts
from kandevd.runtime.records import ExecutionRecord, write_record
from kandevd.schedules import history as hist
from kandevd.schedules.restart.stranded import settle_entry, sweep_records
from kandevd.timeutil import rfc3339

NOW = datetime(2026, 12, 5, 9, 0, tzinfo=UTC)


def record_folder(turns: Path, key: str, log: Path) -> Path:
    folder = turns / key
    folder.mkdir(parents=True)
    write_record(ExecutionRecord(
        record_dir=folder, pid=0, pid_start=0, key=key, run_id="e1", session_id="s",
        started_at=NOW, deadline=NOW + timedelta(hours=1), timeout_s=3600, log_path=log,
        input_path=folder / "input.json", argv=("agent",)))
    (folder / attempts.STDOUT_FILE).write_text('{"summary": "done"}\n')
    (folder / attempts.EXIT_FILE).write_text("0\n")
    return folder


def test_an_unclaimed_record_is_merged_into_its_log_and_removed(tmp_path: Path) -> None:
    turns, log = tmp_path / "turns", tmp_path / "logs" / "00-message.log"
    log.parent.mkdir()
    log.write_text("before\n")
    record_folder(turns, "turn-e1-0", log)
    live = record_folder(turns, "turn-e2-0", tmp_path / "other.log")
    assert sweep_records(turns, lambda key: key == "turn-e2-0") == 1
    assert sorted(p.name for p in turns.iterdir()) == ["turn-e2-0"]
    assert live.is_dir()
    assert log.read_text() == 'before\n{"summary": "done"}\n'
    assert sweep_records(turns, lambda key: False) == 1
    assert list(turns.iterdir()) == []


def test_no_folder_no_sweep(tmp_path: Path) -> None:
    assert sweep_records(tmp_path / "absent", lambda key: False) == 0


def test_a_run_left_behind_ends_as_its_turns_ended() -> None:
    def entry(*turns: tuple[str, str, str | None]) -> dict[str, Any]:
        return {"turns": [{"index": i, "kind": kind, "status": status, "error": error}
                          for i, (kind, status, error) in enumerate(turns)]}
    lost = hist.RESTART_ERROR
    assert hist.outcome_after_restart(entry()) == ("error", lost)  # no turn found
    assert hist.outcome_after_restart(entry(("message", "success", None))) == ("success", None)
    assert hist.outcome_after_restart(entry(("message", "success", None),
                                            ("pulse", "error", "exit code 2"))) == (
        "success", None)  # a pulse's outcome never counts
    assert hist.outcome_after_restart(entry(("message", "error", lost))) == ("error", lost)
    assert hist.outcome_after_restart(entry(("message", "success", None),
                                            ("report", "error", "exit code 3"))) == (
        "error", "report turn 2 failed: exit code 3")
    assert hist.outcome_after_restart(entry(("message", "stopped", "stopped: x"))) == (
        "stopped", "stopped: x")
    assert hist.outcome_after_restart(entry(("message", "running", None))) is None


def test_settling_ends_the_run_and_brings_back_turns_its_file_never_had(
        tmp_path: Path) -> None:
    """A full disk kept the entry's writes in memory and the daemon stopped: the file has
    the first turn running, the records have both turns' ends."""
    turns, logs = tmp_path / "turns", tmp_path / "logs"
    logs.mkdir()
    history = hist.History(tmp_path / "wf", retention_days=90, backlog=hist.PendingWrites())
    history.record_start({"id": "e1", "schedule_id": "s", "status": "error",
                          "error": hist.RESTART_ERROR, "started_at": rfc3339(NOW),
                          "turns": [{"index": 0, "kind": "message", "message": "a",
                                     "status": "error", "error": hist.RESTART_ERROR,
                                     "log_path": str(logs / "00-message.log"),
                                     "cost_cents": 0}]}, NOW)
    record_folder(turns, "turn-e1-0", logs / "00-message.log")
    second = record_folder(turns, "turn-e1-1", logs / "01-report.log")
    (second / "input.json").write_text(json.dumps({
        "kind": "turn", "message": "report it", "workshop_mode": "run",
        "turn": {"index": 1, "kind": "report"}}))
    count, final = settle_entry(history, "e1", turns)
    assert count == 2 and final is not None
    [written] = history.entries()
    assert written == final
    assert (final["status"], final["error"]) == ("success", None)
    assert [(t["index"], t["kind"], t.get("message"), t["status"], t.get("output"))
            for t in final["turns"]] == [(0, "message", "a", "success", "done"),
                                         (1, "report", "report it", "success", "done")]
    assert not (turns / "turn-e1-0").exists() and not second.exists()
