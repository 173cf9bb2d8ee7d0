"""Retention (kandevd.runqueue.retention over kandevd.store.runs.retention) against a real
SQLite file and a real home folder.

Runs are written with plain SQL at chosen times, each with the files a run
leaves in the home (its log, its input, its working folder, its attempt
journal); the pruner is driven with an explicit ``now``. Afterwards the rows
and the files are read back: what went must be exactly what the rules say.
"""

from __future__ import annotations

import itertools
import logging
import os
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kandevd.bus import EventBus
from kandevd.config import build_config
from kandevd.office.budgets import RETENTION_KEEPS_COUNTED_RUNS
from kandevd.paths import HomeLayout
from kandevd.runqueue.loop import QueueLoop
from kandevd.runqueue.retention import RunPruner
from kandevd.runqueue.service import RunQueue
from kandevd.runs.model import IDEMPOTENCY_WINDOW_S, TERMINAL
from kandevd.runtime import AgentRuntime
from kandevd.store.open import open_store
from kandevd.store.runs import RunRepository
from kandevd.store.runs.retention import ExpiredRuns, db_status, oldest_run_at
from kandevd.store.sqlite import Store, db_size_bytes
from kandevd.timeutil import after, rfc3339
from tests.support.stores import sqlite_only

T0 = datetime(2026, 3, 15, 12, 0, 0, tzinfo=UTC)
DAY = 86400.0
STATUSES = ("queued", "claimed", "finished", "failed", "cancelled")
_ids = itertools.count()


@dataclass
class Home:
    layout: HomeLayout
    store: Store

    def close(self) -> None:
        self.store.close()


def open_home(root: Path, location: str | None = None) -> Home:
    layout = HomeLayout(root.resolve())
    for folder in (layout.run_logs, layout.runs, layout.attempts):
        folder.mkdir(parents=True, exist_ok=True)
    store = open_store(location or layout.db)
    now = rfc3339(T0)
    with store.transaction() as conn:
        conn.execute("INSERT INTO workspaces (id, name, office_workflow_id, created_at,"
                     " updated_at) VALUES ('ws', 'ws', '', ?, ?)", (now, now))
        conn.execute("INSERT INTO agents (id, workspace_id, name, profile, cooldown_s, status,"
                     " created_at, updated_at) VALUES ('a', 'ws', 'a', 'default', 0,"
                     " 'active', ?, ?)", (now, now))
    return Home(layout, store)


@pytest.fixture
def home(tmp_path: Path, store_location: str) -> Iterator[Home]:
    h = open_home(tmp_path / "home", store_location)
    yield h
    h.close()


def add_run(home: Home, status: str, ended: datetime | None, *, finished_null: bool = False,
            key: str | None = None, key_at: datetime | None = None,
            cost: float | None = None, files: bool = True,
            log_path: str | None = None, agent: str = "a") -> str:
    """A run that ended at ``ended`` (``finished_null``: only ``updated_at`` says so)."""
    run_id = f"run_{next(_ids):06d}"
    ended = ended or T0
    requested = rfc3339(after(ended, -60))
    log = log_path if log_path is not None else str(home.layout.run_logs / f"{run_id}.log")
    finished = None if finished_null or status not in TERMINAL else rfc3339(ended)
    with home.store.transaction() as conn:
        conn.execute(
            "INSERT INTO runs (id, workspace_id, agent_id, reason, payload, status,"
            " idempotency_key, key_active, requested_at, finished_at, updated_at, log_path,"
            " cost_cents) VALUES (?, 'ws', ?, 'r', '{}', ?, ?, 0, ?, ?, ?, ?, ?)",
            (run_id, agent, status, key, requested, finished, rfc3339(ended), log, cost))
        if key is not None:
            conn.execute("INSERT INTO run_keys (idempotency_key, run_id, created_at)"
                         " VALUES (?, ?, ?)", (key, run_id, rfc3339(key_at or ended)))
    if files:
        layout = home.layout
        (layout.run_logs / f"{run_id}.log").write_text("log\n")
        (layout.run_logs / f"{run_id}.input.json").write_text("{}")
        (layout.runs / run_id).mkdir()
        (layout.runs / run_id / "work.txt").write_text("w")
        (layout.attempts / f"{run_id}.tok.1").mkdir(parents=True)
        (layout.attempts / f"{run_id}.tok.1" / "outcome.json").write_text("{}")
        (layout.attempts / f"{run_id}.tok.0.stdout").write_text("")  # an earlier one's spent stdout
        (layout.attempts / run_id / "old").mkdir(parents=True)  # the legacy layout
    return run_id


def new_agent(home: Home) -> str:
    """Another agent (an agent has at most one claimed run)."""
    agent = f"agent_{next(_ids)}"
    now = rfc3339(T0)
    home.store.execute("INSERT INTO agents (id, workspace_id, name, profile, cooldown_s, status,"
                       " created_at, updated_at) VALUES (?, 'ws', ?, 'default', 0, 'active',"
                       " ?, ?)", (agent, agent, now, now))
    return agent


def run_files(home: Home, run_id: str) -> list[Path]:
    layout = home.layout
    return [layout.run_logs / f"{run_id}.log", layout.run_logs / f"{run_id}.input.json",
            layout.runs / run_id, layout.attempts / f"{run_id}.tok.1",
            layout.attempts / f"{run_id}.tok.0.stdout", layout.attempts / run_id]


def run_ids(home: Home) -> set[str]:
    return {r[0] for r in home.store.query("SELECT id FROM runs")}


def make_pruner(home: Home, retention_days: float, **kwargs: Any) -> RunPruner:
    """The daemon's pruner: Office budgets keep the costed runs they count."""
    return RunPruner(ExpiredRuns(home.store, keep=[RETENTION_KEEPS_COUNTED_RUNS]), home.layout,
                     retention_days, **kwargs)


def prune_all(pruner: RunPruner, now: datetime) -> int:
    total = 0
    for _ in range(10_000):
        result = pruner.prune(now)
        total += result.deleted
        if not result.more:
            return total
    raise AssertionError("pruning never finished")


# -- the rules, over random run sets and clocks ----------------------------------------------

run_spec = st.tuples(
    st.sampled_from(STATUSES),
    st.floats(min_value=-3.0, max_value=3.0),            # ended, in days around the cutoff
    st.booleans(),                                        # finished_at NULL (updated_at only)
    st.sampled_from([None, "fresh", "stale"]),            # idempotency key and its age
)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(run_spec, max_size=25),
       retention_days=st.sampled_from([0, 0.5, 1, 2.5, 30]),
       clock_shift_days=st.floats(min_value=-400, max_value=400),
       batch=st.integers(min_value=1, max_value=7))
def test_pruning_to_completion_removes_exactly_the_old_terminal_runs_and_their_files(
        tmp_path_factory: pytest.TempPathFactory, specs: list[tuple[str, float, bool, str | None]],
        retention_days: float, clock_shift_days: float, batch: int) -> None:
    home = open_home(tmp_path_factory.mktemp("home"))
    try:
        now = after(T0, clock_shift_days * DAY)
        cutoff = after(now, -retention_days * DAY)
        expect_gone: set[str] = set()
        everyone: set[str] = set()
        for status, days, finished_null, key in specs:
            ended = after(cutoff, days * DAY)
            key_at = {None: None, "fresh": after(now, -IDEMPOTENCY_WINDOW_S / 2),
                      "stale": after(now, -IDEMPOTENCY_WINDOW_S - 60)}[key]
            run_id = add_run(home, status, ended, finished_null=finished_null,
                             key=None if key is None else f"k{next(_ids)}", key_at=key_at,
                             agent=new_agent(home) if status == "claimed" else "a")
            everyone.add(run_id)
            old = ended < cutoff
            if retention_days > 0 and status in TERMINAL and old and key != "fresh":
                expect_gone.add(run_id)
        pruner = make_pruner(home, retention_days, batch=batch, budget_s=0.0)
        assert prune_all(pruner, now) == len(expect_gone)
        assert run_ids(home) == everyone - expect_gone
        for run_id in everyone:
            for path in run_files(home, run_id):
                assert path.exists() == (run_id not in expect_gone), path
        assert pruner.prune(now).deleted == 0  # nothing left to do
    finally:
        home.close()


# -- bounds ---------------------------------------------------------------------------------


def test_one_call_deletes_at_most_one_batch_when_its_budget_is_used_and_the_next_continues(
        home: Home) -> None:
    old = [add_run(home, "finished", after(T0, -40 * DAY + i)) for i in range(7)]
    pruner = make_pruner(home, 30, batch=3, budget_s=0.0)
    first = pruner.prune(T0)
    assert (first.deleted, first.more) == (3, True)
    assert run_ids(home) == set(old[3:])  # the oldest went first
    second = pruner.prune(T0)
    assert (second.deleted, second.more) == (3, True)
    third = pruner.prune(T0)
    assert (third.deleted, third.more) == (1, False)
    assert run_ids(home) == set()


def test_a_call_stops_starting_batches_once_its_time_budget_is_spent(home: Home) -> None:
    for i in range(10):
        add_run(home, "failed", after(T0, -40 * DAY + i), files=False)
    ticks = iter(range(100))  # a clock that advances 1 s per reading
    pruner = make_pruner(home, 30, batch=2, budget_s=2.5,
                       clock=lambda: float(next(ticks)))
    # readings: start 0, after batch 1 -> 1, after batch 2 -> 2, after batch 3 -> 3 >= 2.5
    assert pruner.prune(T0).deleted == 6
    unbounded = make_pruner(home, 30, batch=2, budget_s=60.0)
    assert unbounded.prune(T0).deleted == 4


def test_each_batch_is_its_own_transaction(home: Home) -> None:
    sqlite_only(home.store, "SQLite trace callback")
    for i in range(5):
        add_run(home, "cancelled", after(T0, -40 * DAY + i), files=False)
    begins: list[str] = []
    conn = home.store._conn
    conn.set_trace_callback(lambda sql: begins.append(sql) if sql.startswith("BEGIN") else None)
    try:
        pruner = make_pruner(home, 30, batch=2, budget_s=60.0)
        assert pruner.prune(T0).deleted == 5
        assert len(begins) == 3
        assert pruner.prune(T0).deleted == 0  # nothing to do: not even the write lock
        assert len(begins) == 3
    finally:
        conn.set_trace_callback(home.store._trace)


# -- what is kept ---------------------------------------------------------------------------


def test_queued_and_claimed_runs_are_never_touched_whatever_their_age(home: Home) -> None:
    ancient = after(T0, -3650 * DAY)
    kept = [add_run(home, "queued", ancient),
            add_run(home, "claimed", ancient, agent=new_agent(home))]
    gone = add_run(home, "finished", ancient)
    assert prune_all(make_pruner(home, 1), T0) == 1
    assert run_ids(home) == set(kept)
    assert not any(p.exists() for p in run_files(home, gone))
    assert all(p.exists() for run_id in kept for p in run_files(home, run_id))


def test_retention_zero_keeps_everything(home: Home) -> None:
    add_run(home, "finished", after(T0, -3650 * DAY))
    pruner = make_pruner(home, 0)
    assert not pruner.enabled
    assert pruner.prune(T0).deleted == 0 and len(run_ids(home)) == 1


def test_a_run_whose_key_still_deduplicates_is_kept_until_the_key_expires(home: Home) -> None:
    ended = after(T0, -2 * DAY)
    run_id = add_run(home, "finished", ended, key="k-live", key_at=after(T0, -3600))
    pruner = make_pruner(home, 1)
    assert pruner.prune(T0).deleted == 0
    repo = RunRepository(home.store, "boot")
    again = repo.enqueue(workspace_id="ws", agent_id="a", reason="r", now=T0,
                         idempotency_key="k-live")
    assert again.deduplicated and again.run.id == run_id
    later = after(T0, IDEMPOTENCY_WINDOW_S)
    assert pruner.prune(later).deleted == 1
    fresh = repo.enqueue(workspace_id="ws", agent_id="a", reason="r", now=later,
                         idempotency_key="k-live")
    assert fresh.inserted  # the key expired with its window, as it would have anyway


def test_live_executions_are_kept(home: Home) -> None:
    run_id = add_run(home, "cancelled", after(T0, -40 * DAY))
    pruner = make_pruner(home, 30)
    assert pruner.prune(T0, live={run_id}).deleted == 0
    assert pruner.prune(T0).deleted == 1


def test_costed_runs_a_budget_still_counts_are_kept(home: Home) -> None:
    now = rfc3339(T0)
    with home.store.transaction() as conn:
        conn.execute("INSERT INTO agents (id, workspace_id, name, profile, cooldown_s, status,"
                     " created_at, updated_at) VALUES ('b', 'ws', 'b', 'default', 0,"
                     " 'active', ?, ?)", (now, now))
        conn.execute("INSERT INTO office_budget_policies (id, workspace_id, scope_type,"
                     " scope_id, limit_cents, period, created_at) VALUES"
                     " ('p1', 'ws', 'agent', 'a', 100, 'lifetime', ?),"
                     " ('p2', 'ws', 'agent', 'b', 100, 'monthly', ?)", (now, now))
    lifetime = add_run(home, "finished", after(T0, -400 * DAY), cost=5.0)
    uncosted = add_run(home, "finished", after(T0, -400 * DAY))
    this_month = add_run(home, "finished", datetime(2026, 3, 1, 0, 0, 1, tzinfo=UTC),
                         cost=5.0, agent="b")
    last_month = add_run(home, "finished", datetime(2026, 2, 28, 23, 0, tzinfo=UTC),
                         cost=5.0, agent="b")
    assert prune_all(make_pruner(home, 10), T0) == 2
    assert run_ids(home) == {lifetime, this_month}
    assert uncosted not in run_ids(home) and last_month not in run_ids(home)


# -- files ----------------------------------------------------------------------------------


def test_files_outside_the_home_are_never_removed(home: Home, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    victim = outside / "precious.log"
    victim.write_text("keep me")
    add_run(home, "finished", after(T0, -40 * DAY), log_path=str(victim))
    sneaky = home.layout.run_logs / "link"
    sneaky.symlink_to(outside)
    add_run(home, "finished", after(T0, -40 * DAY), log_path=str(sneaky / "precious.log"))
    add_run(home, "finished", after(T0, -40 * DAY),
            log_path=str(home.layout.root / ".." / "elsewhere" / "precious.log"))
    linked_id = add_run(home, "failed", after(T0, -40 * DAY), files=False)
    (home.layout.runs / linked_id).symlink_to(outside)  # its folder is a link out
    assert prune_all(make_pruner(home, 30), T0) == 4
    assert victim.read_text() == "keep me"
    assert not os.path.lexists(home.layout.runs / linked_id)  # the link went, not its target
    assert outside.is_dir() and victim.exists()


def test_a_log_path_elsewhere_in_the_home_goes_with_its_input(home: Home) -> None:
    other = home.layout.logs / "custom"
    other.mkdir()
    (other / "x.log").write_text("x")
    (other / "x.input.json").write_text("{}")
    add_run(home, "finished", after(T0, -40 * DAY), log_path=str(other / "x.log"))
    assert prune_all(make_pruner(home, 30), T0) == 1
    assert list(other.iterdir()) == []


def test_files_stay_when_the_batch_rolls_back(home: Home) -> None:
    sqlite_only(home.store, "a SQLite trigger makes the batch fail")
    run_id = add_run(home, "finished", after(T0, -40 * DAY))
    home.store.execute("CREATE TRIGGER no_delete BEFORE DELETE ON runs"
                       " BEGIN SELECT RAISE(ABORT, 'refused'); END")
    with pytest.raises(sqlite3.IntegrityError):
        make_pruner(home, 30).prune(T0)
    assert run_ids(home) == {run_id}
    assert all(p.exists() for p in run_files(home, run_id))


# -- the log line, the status and the query plan --------------------------------------------


def test_one_info_line_per_pass_that_deleted_something(home: Home,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    kept = add_run(home, "queued", after(T0, -50 * DAY))
    for i in range(5):
        add_run(home, "finished", after(T0, -40 * DAY + i))
    pruner = make_pruner(home, 30, batch=2, budget_s=60.0)
    with caplog.at_level(logging.INFO, logger="kandevd.store.retention"):
        assert pruner.prune(T0).deleted == 5
        assert pruner.prune(T0).deleted == 0
    lines = [r.getMessage() for r in caplog.records]
    requested = home.store.query_one("SELECT requested_at FROM runs WHERE id = ?", (kept,))[0]
    assert lines == [f"retention: deleted 5 terminal runs older than 30 days "
                     f"(oldest kept: {requested})"]


def test_db_status(home: Home) -> None:
    sqlite_only(home.store, "the size of the database file")
    assert oldest_run_at(home.store) is None
    first = add_run(home, "finished", after(T0, -5 * DAY))
    add_run(home, "queued", T0)
    status = db_status(home.store, 30)
    assert status["retention_days"] == 30
    assert status["oldest_run_at"] == home.store.query_one(
        "SELECT requested_at FROM runs WHERE id = ?", (first,))[0]
    wal = Path(home.store.path + "-wal")
    expected = os.stat(home.store.path).st_size + (wal.stat().st_size if wal.exists() else 0)
    assert status["size_bytes"] == db_size_bytes(home.store.path) == expected > 0


def test_the_candidate_query_uses_the_retention_index(home: Home) -> None:
    sqlite_only(home.store, "EXPLAIN QUERY PLAN")
    plan = [r["detail"] for r in home.store.query(
        "EXPLAIN QUERY PLAN " + ExpiredRuns(home.store,
                                             keep=[RETENTION_KEEPS_COUNTED_RUNS])._candidates,
        {"cutoff": rfc3339(T0), "key_cutoff": rfc3339(T0), "month_start": rfc3339(T0),
         "limit": 200})]
    assert any("USING INDEX runs_terminal_ended" in line for line in plan), plan
    assert not any(line.startswith("SCAN r") or "SCAN runs" in line for line in plan), plan
    assert not any("TEMP B-TREE" in line for line in plan), plan
    assert any("USING INDEX idx_run_keys_run_id" in line for line in plan), plan


# -- the queue loop's safety pass -------------------------------------------------------------


def make_loop(home: Home, pruner: RunPruner, safety_interval_s: float = 5.0) -> QueueLoop:
    config = build_config({"queue": {"safety_interval_s": safety_interval_s}}, environ={})
    runtime = AgentRuntime(1, 1.0)
    queue = RunQueue(RunRepository(home.store, "boot"), runtime, config, home.layout,
                     EventBus())
    return QueueLoop(queue, safety_interval_s=safety_interval_s, max_claims_per_tick=10,
                     pruner=pruner)


def test_the_safety_pass_prunes_at_most_once_per_interval_and_continues_later(
        home: Home) -> None:
    for i in range(5):
        add_run(home, "finished", after(T0, -40 * DAY + i))
    loop = make_loop(home, make_pruner(home, 30, batch=2, budget_s=0.0))
    loop.tick(T0)
    assert len(run_ids(home)) == 3
    loop.tick(after(T0, 1))  # within the safety interval: no pruning
    assert len(run_ids(home)) == 3
    loop.tick(after(T0, 5))
    loop.tick(after(T0, 10))
    assert run_ids(home) == set()


def test_a_failing_retention_pass_never_disturbs_the_queue(
        home: Home, caplog: pytest.LogCaptureFixture) -> None:
    sqlite_only(home.store, "a SQLite trigger makes the batch fail")
    add_run(home, "finished", after(T0, -40 * DAY))
    home.store.execute("CREATE TRIGGER no_delete BEFORE DELETE ON runs"
                       " BEGIN SELECT RAISE(ABORT, 'refused'); END")
    loop = make_loop(home, make_pruner(home, 30))
    with caplog.at_level(logging.WARNING, logger="kandevd.queue.loop"):
        assert loop.tick(T0) == 5.0  # the usual wait: the pass went on
    assert "retention pass failed" in caplog.text
    home.store.execute("DROP TRIGGER no_delete")
    loop.tick(after(T0, 5))
    assert run_ids(home) == set()
