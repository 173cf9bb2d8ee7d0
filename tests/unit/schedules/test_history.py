"""Run history: pruning, paging, restart repair, and seeding runtime state from it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from kandevd.schedules import history as hist
from kandevd.schedules.jobs import seed_state
from kandevd.timeutil import rfc3339

NOW = datetime(2026, 12, 3, 12, tzinfo=UTC)
STATUSES = ["running", "success", "error", "stopped"]

entries_strategy = st.lists(st.fixed_dictionaries({
    "id": st.uuids().map(str),
    "schedule_id": st.sampled_from(["a", "b"]),
    "status": st.sampled_from(STATUSES),
    "age_days": st.one_of(st.none(), st.floats(min_value=0, max_value=400)),
}), max_size=40)


def materialize(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    entries = []
    for spec in specs:
        entry = {"id": spec["id"], "schedule_id": spec["schedule_id"], "status": spec["status"]}
        if spec["age_days"] is not None:
            entry["started_at"] = rfc3339(NOW - timedelta(days=spec["age_days"]))
        entries.append(entry)
    return entries


@given(entries_strategy, st.sampled_from([1, 30, 90]))
def test_prune_drops_exactly_the_old_terminal_entries_and_keeps_order(
        specs: list[dict[str, Any]], days: int) -> None:
    entries = materialize(specs)
    kept = hist.prune(entries, NOW, days)
    expected = [e for e, s in zip(entries, specs, strict=True)
                if s["status"] == "running" or s["age_days"] is None or s["age_days"] <= days]
    assert kept == expected


@given(entries_strategy)
def test_a_retention_of_0_days_keeps_every_entry(specs: list[dict[str, Any]]) -> None:
    entries = materialize(specs)
    assert hist.prune(entries, NOW, 0) == entries


@given(entries_strategy, st.integers(1, 10), st.integers(0, 50))
def test_pages_cover_one_schedule_in_order(specs: list[dict[str, Any]], limit: int,
                                           offset: int) -> None:
    entries = materialize(specs)
    result = hist.page(entries, schedule_id="a", limit=limit, offset=offset)
    mine = [e for e in entries if e["schedule_id"] == "a"]
    assert result["total"] == len(mine)
    assert result["items"] == mine[offset:offset + limit]
    assert (result["limit"], result["offset"]) == (limit, offset)


def test_record_start_prunes_and_puts_the_new_entry_first(tmp_path: Path) -> None:
    history = hist.History(tmp_path, retention_days=90, backlog=hist.PendingWrites())
    old = {"id": "old", "status": "success", "completed_at": rfc3339(NOW - timedelta(days=91))}
    stale_running = {"id": "r", "status": "running",
                     "started_at": rfc3339(NOW - timedelta(days=200))}
    recent = {"id": "recent", "status": "error", "completed_at": rfc3339(NOW)}
    undated = {"id": "undated", "status": "success"}
    history.file.write([recent, old, stale_running, undated])
    history.record_start({"id": "new", "status": "running"}, NOW)
    assert [e["id"] for e in history.entries()] == ["new", "recent", "r", "undated"]


def test_repair_after_restart_marks_error_with_the_restart_message(tmp_path: Path) -> None:
    history = hist.History(tmp_path, retention_days=90, backlog=hist.PendingWrites())
    history.file.write([{"id": "x", "status": "running", "started_at": rfc3339(NOW)},
                        {"id": "y", "status": "success"}])
    entries, fixed = history.repair_after_restart(NOW + timedelta(seconds=3))
    assert fixed == ["x"] and entries == history.entries()
    first, second = history.entries()
    assert first["status"] == "error" and first["error"] == "interrupted: server restarted"
    assert first["completed_at"] == rfc3339(NOW + timedelta(seconds=3))
    assert first["duration_ms"] == 3000
    assert second == {"id": "y", "status": "success"}


def test_a_corrupt_history_is_moved_aside_and_a_fresh_one_started(tmp_path: Path) -> None:
    (tmp_path / hist.HISTORY).write_text('[{"id": "x"')
    reports: list[Any] = []
    history = hist.History(tmp_path, retention_days=90, backlog=hist.PendingWrites(),
                           on_corrupt=reports.append)
    history.record_start({"id": "new", "status": "running"}, NOW)
    assert [e["id"] for e in history.entries()] == ["new"]
    [aside] = [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert aside.read_text() == '[{"id": "x"' and len(reports) == 1


def test_seed_state_reads_the_newest_entry_and_the_failure_streak() -> None:
    entries = [
        {"status": "running", "started_at": "t4", "session_id": "s4"},
        {"status": "error", "started_at": "t3", "error": "boom"},
        {"status": "error", "started_at": "t2"},
        {"status": "success", "started_at": "t1"},
        {"status": "error", "started_at": "t0"},
    ]
    state = seed_state(entries)
    assert (state.last_status, state.last_run_at, state.last_session_id) == ("running", "t4",
                                                                             "s4")
    assert state.run_count == 4 and state.consecutive_failures == 2
    assert seed_state([]).last_status is None


def test_repair_after_restart_also_closes_the_turn_that_was_running(tmp_path: Path) -> None:
    history = hist.History(tmp_path, retention_days=90, backlog=hist.PendingWrites())
    history.file.write([{"id": "x", "status": "running", "started_at": rfc3339(NOW),
                         "turns": [{"kind": "message", "status": "success"},
                                   {"kind": "message", "status": "running"}]}])
    [entry], _ = history.repair_after_restart(NOW)
    assert [t["status"] for t in entry["turns"]] == ["success", "error"]
    assert entry["turns"][1]["error"] == "interrupted: server restarted"


def test_repair_after_restart_reports_an_adopted_turn_whose_adopter_died(
        tmp_path: Path) -> None:
    history = hist.History(tmp_path, retention_days=90, backlog=hist.PendingWrites())
    interrupted = {"id": "y", "status": "error", "error": hist.RESTART_ERROR,
                   "completed_at": rfc3339(NOW), "started_at": rfc3339(NOW),
                   "turns": [{"kind": "message", "status": "running", "adopted_at": "t"}]}
    history.file.write([interrupted, {"id": "z", "status": "success", "turns": []}])
    entries, repaired = history.repair_after_restart(NOW)
    assert repaired == ["y"]
    assert entries[0]["completed_at"] == interrupted["completed_at"]  # its end stays
    assert entries[0]["turns"][0]["status"] == "error"
