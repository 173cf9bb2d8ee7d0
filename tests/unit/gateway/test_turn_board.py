"""TurnBoard on a real store (SQLite and PostgreSQL): a turn one daemon owns is handed
out, fed and ended through another daemon's board, as two daemons on one database do;
stops, lost and silent runners, a daemon's stop."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from kandevd.bus import EventBus
from kandevd.gateway.endings import LogGap, UnknownExecution
from kandevd.gateway.protocol import token_hash
from kandevd.gateway.turns import Turn, TurnBoard
from kandevd.runtime import ERROR, INTERRUPTED, STOPPED, ExecutionResult, ExecutionSpec
from kandevd.store.base import BaseStore
from kandevd.store.cluster import ClusterTables
from kandevd.store.open import open_store
from kandevd.store.runners import Runners
from kandevd.store.turns import RemoteTurnRows

T0 = datetime(2026, 12, 7, 9, 0, 0).astimezone()


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
def store(store_location: str) -> Iterator[BaseStore]:
    opened = open_store(store_location)
    try:
        yield opened
    finally:
        opened.close()


class Daemons:
    """Two daemons' boards on one database: ``a`` owns the turns, ``b`` serves runners."""

    def __init__(self, store: BaseStore, tmp_path: Path, alive_s: float | None = None) -> None:
        self.store = store
        self.tmp = tmp_path
        self.clock = Clock()
        self.runners = Runners(store)
        self.runners.add("box", ["gpu"], token_hash("kdr_box"), T0)
        self.runners.add("cpu", ["cpu"], token_hash("kdr_cpu"), T0)
        self.a, self.b = (TurnBoard(RemoteTurnRows(store, owner, owners_dead_after_s=alive_s),
                                    self.runners, EventBus(), dead_after_s=30,
                                    clock=self.clock) for owner in ("a", "b"))
        self.ended: list[ExecutionResult] = []

    def turn(self, key: str = "s1.t1") -> Turn:
        spec = ExecutionSpec(key=key, kind="turn", argv=("agent",),
                             stdin={"kind": "turn", "message": "hi"}, cwd=self.tmp,
                             log_path=self.tmp / f"{key}.log", timeout_s=60, run_id=key)
        turn = Turn(spec, "coder", ("gpu",), self.ended.append)
        self.clock.now += timedelta(milliseconds=1)  # (the order they were handed over)
        assert self.a.add(turn)
        return turn

    def seen(self, name: str, at: datetime) -> None:
        self.runners.seen(name, at)


@pytest.fixture
def two(store: BaseStore, tmp_path: Path) -> Daemons:
    return Daemons(store, tmp_path)


def test_a_turn_one_daemon_owns_runs_through_another_daemons_gateway(two: Daemons) -> None:
    turn = two.turn()
    assert two.b.take("cpu", ("cpu",), 4) == []  # (its labels do not cover the turn)
    [handed] = two.b.take("box", ("gpu", "big"), 4)
    assert handed["id"] == turn.token and handed["kind"] == "turn"
    assert handed["profile"] == "coder" and handed["stdin"]["message"] == "hi"
    assert two.b.take("box", ("gpu",), 4) == []  # (taken once)
    assert two.b.append("box", turn.token, 0, b"hello ") == 6
    assert two.b.append("box", turn.token, 3, b"lo world") == 11  # (the overlap skipped)
    with pytest.raises(LogGap) as gap:
        two.b.append("box", turn.token, 20, b"late")
    assert gap.value.received == 11
    with pytest.raises(UnknownExecution):  # (not the other runner's)
        two.b.append("cpu", turn.token, 11, b"x")
    two.seen("box", T0)
    two.a.watch()
    assert turn.spec.log_path.read_bytes() == b"hello world"  # (read by the owner)
    assert two.ended == []
    assert two.b.end("box", turn.token, {"outcome": "succeeded", "summary": "done",
                                          "cost_cents": 3, "evaluation": {"ok": True}})
    assert not two.b.end("box", turn.token, {"outcome": "failed"})  # (once)
    assert two.ended == []  # (the owner learns it at its next look)
    two.a.watch()
    [result] = two.ended
    assert (result.key, result.outcome, result.summary, result.cost_cents,
            result.evaluation) == ("s1.t1", "succeeded", "done", 3.0, {"ok": True})
    assert two.a.rows.own([turn.token]) == {} and two.b.held("box") == {}


def test_a_turn_its_runner_interrupted_waits_for_a_runner_again_its_output_kept(
        two: Daemons) -> None:
    """The runner stopped gracefully (its agents end interrupted): the turn is handed
    again, as a run is re-queued; the next execution's output follows the first's."""
    turn = two.turn()
    [first] = two.b.take("box", ("gpu",), 1)
    assert two.b.append("box", first["id"], 0, b"part one\n") == 9
    assert two.b.end("box", first["id"], {"outcome": INTERRUPTED,
                                          "error": "runner shutting down"})
    assert two.b.held("box") == {}
    with pytest.raises(UnknownExecution):  # (no longer its)
        two.b.append("box", first["id"], 9, b"late")
    [again] = two.b.take("box", ("gpu",), 1)  # (its restarted process, or another)
    assert again["id"] == turn.token
    assert two.b.append("box", again["id"], 0, b"all of it\n") == 10  # (its own offsets)
    with pytest.raises(LogGap) as gap:
        two.b.append("box", again["id"], 12, b"x")
    assert gap.value.received == 10
    assert two.b.end("box", again["id"], {"outcome": "succeeded", "summary": "done"})
    two.seen("box", T0)
    two.a.watch()
    assert [(r.outcome, r.summary) for r in two.ended] == [("succeeded", "done")]
    log = turn.spec.log_path.read_text()
    assert log.startswith("part one\n\n==== turn interrupted on runner box (runner shutting"
                          " down) at ") and log.endswith("; waiting for a runner again ===="
                                                         "\nall of it\n"), log


def test_a_turn_stopped_by_its_session_ends_when_its_runner_interrupts_it(
        two: Daemons) -> None:
    turn = two.turn()
    [handed] = two.b.take("box", ("gpu",), 1)
    assert two.a.stop(turn.spec.key)
    assert two.b.end("box", handed["id"], {"outcome": INTERRUPTED})
    assert two.b.take("box", ("gpu",), 1) == []  # (not handed again)
    two.a.watch()
    assert [r.outcome for r in two.ended] == [INTERRUPTED]


def test_an_end_the_owners_own_gateway_takes_reaches_the_session_at_once(
        two: Daemons) -> None:
    turn = two.turn()
    [handed] = two.a.take("box", ("gpu",), 1)
    assert two.a.append("box", handed["id"], 0, b"out\n") == 4
    assert turn.spec.log_path.read_bytes() == b"out\n"
    assert two.a.end("box", handed["id"], {"outcome": "failed", "exit_code": 2})
    assert [(r.outcome, r.exit_code) for r in two.ended] == [("failed", 2)]


def test_a_stop_ends_a_waiting_turn_now_and_tells_the_runner_of_a_taken_one(
        two: Daemons) -> None:
    waiting = two.turn("s1.t1")
    assert two.a.stop("s1.t1")
    assert [(r.key, r.outcome) for r in two.ended] == [("s1.t1", STOPPED)]
    assert two.b.take("box", ("gpu",), 4) == []
    taken = two.turn("s2.t1")
    two.b.take("box", ("gpu",), 4)
    assert not two.b.held("box")[taken.token].cancel
    assert two.a.stop("s2.t1")
    assert two.b.held("box")[taken.token].cancel  # (its next heartbeat says so)
    assert two.b.end("box", taken.token, {"outcome": STOPPED, "error": "asked"})
    two.seen("box", T0)
    two.a.watch()
    assert [(r.key, r.outcome) for r in two.ended] == [("s1.t1", STOPPED),
                                                      ("s2.t1", STOPPED)]
    assert waiting.token not in two.b.held("box")


def test_a_runner_back_without_its_turn_ends_it_as_an_error_naming_the_runner(
        two: Daemons) -> None:
    kept, lost = two.turn("s1.t1"), two.turn("s2.t1")
    two.b.take("box", ("gpu",), 4)
    assert two.b.lose("box", "runner box restarted without it",
                      keep=frozenset({kept.token})) == 1
    two.seen("box", T0)
    two.a.watch()
    [result] = two.ended
    assert (result.key, result.outcome, result.error) == (
        "s2.t1", ERROR, "runner box restarted without it")
    assert list(two.b.held("box")) == [kept.token]
    # only those taken before a moment are lost by a runner that no longer names them
    assert two.b.lose("box", "gone", handed_before=T0) == 0
    assert lost.token not in two.b.held("box")


def test_the_owner_ends_the_turns_of_a_runner_no_daemon_heard_from(two: Daemons) -> None:
    turn = two.turn()
    two.b.take("box", ("gpu",), 1)
    two.seen("box", T0)
    two.clock.now = T0 + timedelta(seconds=29)
    two.a.watch()
    assert two.ended == []
    two.clock.now = T0 + timedelta(seconds=31)
    two.a.watch()
    [result] = two.ended
    assert result.outcome == ERROR and "runner box was silent for 31s" in (result.error or "")
    assert not two.b.end("box", turn.token, {"outcome": "succeeded"})  # (too late: once)


def test_a_daemon_that_stops_ends_its_turns_interrupted_and_runners_are_told(
        two: Daemons) -> None:
    turn = two.turn("s1.t1")
    two.turn("s2.t1")
    two.b.take("box", ("gpu",), 1)
    two.b.append("box", turn.token, 0, b"partial")
    two.a.close("interrupted: the daemon stopped during the turn")
    assert sorted((r.key, r.outcome) for r in two.ended) == [("s1.t1", INTERRUPTED),
                                                            ("s2.t1", INTERRUPTED)]
    assert turn.spec.log_path.read_bytes() == b"partial"  # (what had arrived is kept)
    assert two.b.held("box") == {}  # (its heartbeat: no longer the runner's)
    assert two.b.take("box", ("gpu",), 4) == []
    assert not two.a.add(Turn(turn.spec, "coder", ("gpu",), two.ended.append))


def test_a_daemon_on_its_own_database_forgets_an_earlier_instances_turns(
        two: Daemons) -> None:
    two.turn()
    assert RemoteTurnRows(two.store, "a-again").forget_others() == 1
    assert two.b.take("box", ("gpu",), 4) == []


def test_on_postgresql_a_stopped_owners_turns_are_not_handed_out_and_are_stopped(
        pg_url: str, tmp_path: Path) -> None:
    store = open_store(pg_url)
    try:
        stopped_owner(store, tmp_path)
    finally:
        store.close()


def stopped_owner(store: BaseStore, tmp_path: Path) -> None:
    tables = ClusterTables(store)  # type: ignore[arg-type]
    for owner in ("a", "b"):
        tables.join(owner, "host", "machine", f"/home/{owner}")
    two = Daemons(store, tmp_path, alive_s=30)
    taken = two.turn("s1.t1")
    two.b.take("box", ("gpu",), 1)
    waiting = two.turn("s2.t1")
    tables.mark_stopped(["a"])
    assert two.b.take("box", ("gpu",), 4) == []
    assert two.b.held("box")[taken.token].cancel  # (nobody would record its end)
    tables.prune(3600)
    assert two.b.held("box") == {} and two.a.rows.own([taken.token, waiting.token]) == {}
