"""Turn records no history entry leads to are swept at start: their output merged into
the log their record names, the folder removed; live turns' records are left alone."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from kandevd.runtime import attempts
from kandevd.runtime.records import ExecutionRecord, write_record
from kandevd.schedules.stranded import sweep_records

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
