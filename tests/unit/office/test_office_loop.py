"""OfficeLoop: fan-out per tick, gating cost, stats, and a stop that joins a busy handler."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from kandevd.config import OfficeConfig
from kandevd.lifecycle import LoopState
from kandevd.office import HandlerResult
from kandevd.office.loop import OfficeLoop
from tests.support.office import OfficeEnv, seeded_env

WAIT_S = 10.0
CONFIG = OfficeConfig(enabled=True, interval_s=30, recovery_lookback_hours=24)


@pytest.fixture
def env(tmp_path: Path, store_location: str) -> Iterator[OfficeEnv]:
    with seeded_env(tmp_path, location=store_location) as made:
        made.model.update_workspace({"id": "ws1", "office_workflow_id": ""})  # no adoption yet
        yield made


def office_loop(env: OfficeEnv, **kwargs: object) -> OfficeLoop:
    return OfficeLoop(env.store, env.queue, env.bus, CONFIG, clock=env.clock, **kwargs)


def test_idle_tick_is_three_probes_and_no_scan(env: OfficeEnv) -> None:
    loop = office_loop(env)
    waits = []
    for _ in range(3):
        assert env.statements_during(lambda: waits.append(loop.tick(env.clock()))) == 3
    assert waits == [30.0, 30.0, 30.0]
    assert loop.stats() == {"ticks": 3, "handler_errors": 0, "recovery_scans": 0,
                            "routine_scans": 0, "budget_scans": 0, "recovered": 0,
                            "routine_fires": 0, "budget_alerts": 0}
    assert env.runs() == []


def test_configuration_created_at_run_time_takes_effect_next_tick(env: OfficeEnv) -> None:
    loop = office_loop(env)
    loop.tick(env.clock())
    env.model.update_workspace({"id": "ws1", "office_workflow_id": "office"})
    env.insert_task("t1", "office")
    env.insert_routine()
    env.insert_budget(limit_cents=1, scope_id="a2")
    env.spend("a2", 5)
    env.clock.advance(minutes=1)
    loop.tick(env.clock())
    stats = loop.stats()
    assert stats["recovery_scans"] == stats["routine_scans"] == stats["budget_scans"] == 1
    assert (stats["recovered"], stats["routine_fires"], stats["budget_alerts"]) == (1, 1, 2)
    reasons = sorted(r.reason for r in env.runs())
    assert reasons == ["routine_trigger", "task_assigned", "work"]


class Blocking:
    """A handler that blocks inside its tick until released (as if stuck in DB work)."""

    name = "blocking"

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.finished = threading.Event()

    def tick(self, now: datetime) -> HandlerResult:
        self.entered.set()
        assert self.release.wait(WAIT_S)
        self.finished.set()
        return HandlerResult(scanned=True, acted=1)


class Failing:
    name = "failing"

    def tick(self, now: datetime) -> HandlerResult:
        raise RuntimeError("boom")


def test_a_failing_handler_is_isolated_and_counted(env: OfficeEnv) -> None:
    quick = Blocking()
    quick.release.set()
    loop = office_loop(env, handlers=[Failing(), quick])
    assert loop.tick(env.clock()) == 30.0
    assert quick.finished.is_set()
    stats = loop.stats()
    assert stats["handler_errors"] == 1 and stats["blocking_scans"] == 1


def test_stop_waits_for_a_handler_mid_tick(env: OfficeEnv) -> None:
    blocking = Blocking()
    loop = office_loop(env, handlers=[blocking])
    loop.start()
    stopped = threading.Event()
    stopper = threading.Thread(target=lambda: (loop.stop(), stopped.set()))
    try:
        assert blocking.entered.wait(WAIT_S)
        stopper.start()
        # stop() is in progress but must not return while the handler works
        assert not stopped.wait(0.3)
        assert loop.state is LoopState.STOPPING and not blocking.finished.is_set()
    finally:
        blocking.release.set()
    stopper.join(WAIT_S)
    assert stopped.is_set() and blocking.finished.is_set()
    assert loop.state is LoopState.STOPPED
    assert loop.stats()["ticks"] == 1


def test_tick_uses_the_given_now(env: OfficeEnv) -> None:
    env.model.update_workspace({"id": "ws1", "office_workflow_id": "office"})
    env.insert_task("t_old", "office", created_at=env.clock() - timedelta(hours=30))
    loop = office_loop(env)
    loop.tick(env.clock())
    assert env.runs() == []
    loop.tick(env.clock() - timedelta(hours=10))         # the past: t_old is inside lookback
    assert [r.task_id for r in env.runs()] == ["t_old"]
