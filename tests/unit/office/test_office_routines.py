"""Routines: APScheduler CronTrigger fire times, CAS claims, concurrency and catch-up.

Time is the injected clock, moved by the test; every tick is ``tick(now)``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kandevd.cron import CronError, parse_cron
from kandevd.office.routines import (
    RoutineScheduler,
    due_fire_times,
    fire_after,
    fire_at_or_after,
    fire_at_or_before,
    routine_key,
)
from kandevd.timeutil import parse_rfc3339, rfc3339
from tests.support.office import T0, OfficeEnv, seeded_env


@pytest.fixture
def env(tmp_path: Path, store_location: str) -> Iterator[OfficeEnv]:
    with seeded_env(tmp_path, location=store_location) as made:
        yield made


def routine_runs(env: OfficeEnv) -> list[dict]:
    return env.runs(reason="routine_trigger")


def scheduled(env: OfficeEnv) -> list[str]:
    return [r.payload["scheduled_for"] for r in routine_runs(env)]


def next_run_at(env: OfficeEnv, routine_id: str = "r1") -> str:
    return env.store.query_one("SELECT next_run_at FROM office_routines WHERE id = ?",
                               (routine_id,))[0]


def minute(moment: datetime) -> str:
    return rfc3339(moment.replace(second=0, microsecond=0))


# -- parsing (kandevd.cron), fire times from APScheduler ---------------------------

@pytest.mark.parametrize(("expr", "tz", "message"), [
    ("* * * *", "UTC", r"^cron_expression: '\* \* \* \*' is not a valid 5-field cron "
                       r"expression: Wrong number of fields; got 4, expected 5$"),
    ("* * * * * *", "UTC", r"^cron_expression: .*got 6, expected 5$"),
    ("61 * * * *", "UTC", r"^cron_expression: .*61"),
    ("0 0 30 2 *", "UTC", r"^cron_expression: '0 0 30 2 \*' never fires$"),
    ("* * * * *", "Mars/Olympus", r"^timezone: unknown time zone 'Mars/Olympus'"),
    ("* * * * *", "../etc/passwd", r"^timezone: unknown time zone"),
])
def test_bad_schedules_name_the_field(expr: str, tz: str, message: str) -> None:
    with pytest.raises(CronError, match=message):
        parse_cron(expr, tz)


def test_time_zone_and_dst() -> None:
    paris = parse_cron("30 9 * * *", "Europe/Paris")
    winter = datetime(2026, 3, 28, 12, tzinfo=UTC)
    assert fire_after(paris, winter) == datetime(2026, 3, 29, 7, 30, tzinfo=UTC)  # CEST now
    assert fire_after(paris, datetime(2026, 3, 27, 12, tzinfo=UTC)) == \
        datetime(2026, 3, 28, 8, 30, tzinfo=UTC)                                  # CET


CRONS = ["* * * * *", "*/7 * * * *", "0 * * * *", "15 3 * * 1-5", "0 0 1 * *",
         "5,35 9-17 * * *", "0 12 29 2 *", "0 9 1,15 * sun"]


@settings(max_examples=60, deadline=None)
@given(expr=st.sampled_from(CRONS),
       start=st.datetimes(min_value=datetime(2025, 1, 1), max_value=datetime(2027, 1, 1),
                          timezones=st.just(UTC)),
       span_min=st.integers(min_value=0, max_value=60 * 24 * 3))
def test_fire_at_or_before_matches_a_forward_walk(expr: str, start: datetime,
                                                  span_min: int) -> None:
    trigger = parse_cron(expr, "UTC")
    end = start + timedelta(minutes=span_min)
    walked = None
    current = fire_at_or_after(trigger, start)
    while current is not None and current <= end:
        walked = current
        current = fire_after(trigger, current)
    assert fire_at_or_before(trigger, end, start) == walked


def test_catch_up_after_a_year_is_bounded_and_exact() -> None:
    trigger = parse_cron("* * * * *", "UTC")
    first = datetime(2025, 3, 1, tzinfo=UTC)
    now = datetime(2026, 3, 1, 0, 0, 30, tzinfo=UTC)
    began = time.perf_counter()
    times, dropped = due_fire_times(trigger, first, now, 25)
    assert time.perf_counter() - began < 2.0  # never walks the ~525 000 missed minutes
    assert dropped
    assert times == [now.replace(second=0) - timedelta(minutes=24 - i) for i in range(25)]


# -- firing --------------------------------------------------------------------------

def test_new_routine_is_due_at_the_next_fire_time(env: OfficeEnv) -> None:
    assert env.insert_routine() == "2026-03-10T12:01:00.000000Z"
    assert RoutineScheduler(env.store, env.queue).tick(env.clock()).acted == 0


@pytest.mark.parametrize(("cron", "timezone", "expected"), [
    ("0 9 * * 0", "UTC", "2026-03-15T09:00:00.000000Z"),            # T0 is a Tuesday
    ("0 9 * * 7", "Europe/Berlin", "2026-03-15T08:00:00.000000Z"),
    ("0 9 * * 1-5", "UTC", "2026-03-11T09:00:00.000000Z"),
])
def test_a_routine_weekday_is_standard_cron(env: OfficeEnv, cron: str, timezone: str,
                                            expected: str) -> None:
    assert env.clock().strftime("%a") == "Tue"
    assert env.insert_routine(cron=cron, timezone=timezone) == expected


def test_every_minute_fires_once_per_minute_across_many_ticks(env: OfficeEnv) -> None:
    env.insert_routine(payload={"topic": "news", "routine_id": "spoofed"})
    handler = RoutineScheduler(env.store, env.queue)
    fires = 0
    for _ in range(10 * 60 // 7 + 1):           # ten minutes of ticks every 7 s
        env.clock.advance(seconds=7)
        fires += handler.tick(env.clock()).acted
    assert fires == 10
    expected = [minute(T0 + timedelta(minutes=m)) for m in range(1, 11)]
    assert scheduled(env) == expected
    runs = routine_runs(env)
    assert [r.idempotency_key for r in runs] == [
        routine_key("r1", parse_rfc3339(s)) for s in expected]
    first_minute = int(parse_rfc3339(expected[0]).timestamp()) // 60
    assert runs[0].idempotency_key == f"routine:r1:{first_minute}"
    assert runs[0].payload == {"topic": "news", "routine_id": "r1",
                                  "scheduled_for": expected[0]}
    assert {r.agent_id for r in runs} == {"a1"} and {r.task_id for r in runs} == {None}
    assert next_run_at(env) == minute(env.clock() + timedelta(minutes=1))
    last = env.store.query_one("SELECT last_run_at FROM office_routines")[0]
    assert last == expected[-1]


def test_skip_if_active_skips_while_its_run_is_queued_or_claimed(env: OfficeEnv) -> None:
    env.insert_routine(concurrency="skip_if_active")
    handler = RoutineScheduler(env.store, env.queue)
    env.clock.advance(minutes=1)
    assert handler.tick(env.clock()).acted == 1
    (first,) = routine_runs(env)
    env.clock.advance(minutes=1)
    assert handler.tick(env.clock()).acted == 0             # queued: skipped
    claim = env.repo.claim_next(env.clock())
    assert claim is not None and claim.run.id == first.id
    env.clock.advance(minutes=1)
    assert handler.tick(env.clock()).acted == 0             # claimed: skipped
    assert env.repo.finish(first.id, claim.token, now=env.clock(), summary=None,
                           cost_cents=None, log_path=None)
    env.clock.advance(minutes=1)
    assert handler.tick(env.clock()).acted == 1             # finished: fires again
    assert scheduled(env) == [minute(T0 + timedelta(minutes=1)),
                              minute(T0 + timedelta(minutes=4))]


def test_skip_if_active_ignores_runs_of_other_routines(env: OfficeEnv) -> None:
    env.insert_routine("r1", concurrency="skip_if_active")
    env.insert_routine("r2", concurrency="skip_if_active")
    handler = RoutineScheduler(env.store, env.queue)
    env.clock.advance(minutes=1)
    assert handler.tick(env.clock()).acted == 2


def test_catch_up_skip_missed_fires_once_for_now(env: OfficeEnv) -> None:
    env.insert_routine(catch_up="skip_missed")
    env.clock.advance(hours=1, seconds=20)               # the daemon was down for an hour
    assert RoutineScheduler(env.store, env.queue).tick(env.clock()).acted == 1
    assert scheduled(env) == [minute(env.clock())]       # the latest missed time only
    assert next_run_at(env) == minute(env.clock() + timedelta(minutes=1))


def test_catch_up_enqueue_missed_with_cap(env: OfficeEnv) -> None:
    env.insert_routine(catch_up="enqueue_missed_with_cap", catch_up_max=5)
    env.clock.advance(hours=1, seconds=20)               # 60 missed fire times
    handler = RoutineScheduler(env.store, env.queue)
    assert handler.tick(env.clock()).acted == 5
    now_minute = env.clock().replace(second=0, microsecond=0)
    assert scheduled(env) == [rfc3339(now_minute - timedelta(minutes=4 - i)) for i in range(5)]
    assert handler.tick(env.clock()).acted == 0
    env.clock.advance(minutes=1)
    assert handler.tick(env.clock()).acted == 1          # back to one per minute


def test_catch_up_below_the_cap_enqueues_every_missed_time(env: OfficeEnv) -> None:
    env.insert_routine(catch_up="enqueue_missed_with_cap", catch_up_max=25)
    env.clock.advance(minutes=10, seconds=5)
    assert RoutineScheduler(env.store, env.queue).tick(env.clock()).acted == 10
    assert scheduled(env) == [minute(T0 + timedelta(minutes=m)) for m in range(1, 11)]


def test_catch_up_with_skip_if_active_keeps_one_active_run(env: OfficeEnv) -> None:
    env.insert_routine(catch_up="enqueue_missed_with_cap", concurrency="skip_if_active")
    env.clock.advance(minutes=10, seconds=5)
    assert RoutineScheduler(env.store, env.queue).tick(env.clock()).acted == 1


def test_cas_prevents_a_double_fire(env: OfficeEnv) -> None:
    env.insert_routine()
    env.clock.advance(minutes=1)
    one = RoutineScheduler(env.store, env.queue)
    two = RoutineScheduler(env.store, env.queue)
    (stale,) = one.due(env.clock())             # both read the same due row ...
    (also_stale,) = two.due(env.clock())
    assert one.fire(stale, env.clock()) == 1    # ... only the first compare-and-set wins
    assert two.fire(also_stale, env.clock()) == 0
    assert len(routine_runs(env)) == 1


def test_racing_ticks_fire_once(env: OfficeEnv) -> None:
    env.insert_routine()
    env.clock.advance(minutes=1)
    barrier = threading.Barrier(4)
    results: list[int] = []

    def tick() -> None:
        handler = RoutineScheduler(env.store, env.queue)
        barrier.wait()
        results.append(handler.tick(env.clock()).acted)

    threads = [threading.Thread(target=tick) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [0, 0, 0, 1] and len(routine_runs(env)) == 1


def test_paused_routines_are_not_due_and_do_not_open_the_gate(env: OfficeEnv) -> None:
    env.insert_routine(status="paused")
    env.clock.advance(minutes=5)
    handler = RoutineScheduler(env.store, env.queue)
    results = []
    assert env.statements_during(lambda: results.append(handler.tick(env.clock()))) == 1
    assert results[0].scanned is False and routine_runs(env) == []


def test_gate_without_routines_is_one_query(env: OfficeEnv) -> None:
    handler = RoutineScheduler(env.store, env.queue)
    results = []
    assert env.statements_during(lambda: results.append(handler.tick(env.clock()))) == 1
    assert results[0].scanned is False
    env.insert_routine()                         # created at run time: the next tick sees it
    assert handler.tick(env.clock()).scanned


def test_a_routine_without_next_run_at_is_scheduled_not_fired(env: OfficeEnv) -> None:
    env.insert_routine()
    env.store.execute("UPDATE office_routines SET next_run_at = NULL")
    handler = RoutineScheduler(env.store, env.queue)
    assert handler.tick(env.clock()).acted == 0
    assert next_run_at(env) == "2026-03-10T12:01:00.000000Z"
    assert routine_runs(env) == []


def test_the_persisted_next_run_at_is_the_truth_even_off_the_cron_grid(env: OfficeEnv) -> None:
    env.insert_routine(cron="0 * * * *")
    off_grid = T0 + timedelta(seconds=30)                 # 12:00:30.25, not a cron time
    env.store.execute("UPDATE office_routines SET next_run_at = ?", (rfc3339(off_grid),))
    env.clock.set(off_grid + timedelta(seconds=1))
    handler = RoutineScheduler(env.store, env.queue)
    assert handler.tick(env.clock()).acted == 1
    assert scheduled(env) == [rfc3339(off_grid)]
    assert next_run_at(env) == "2026-03-10T13:00:00.000000Z"    # back on the grid


def test_due_fire_times_counts_the_persisted_time_as_the_first() -> None:
    trigger = parse_cron("*/10 * * * *", "UTC")
    first = datetime(2026, 1, 1, 0, 3, tzinfo=UTC)
    now = datetime(2026, 1, 1, 0, 31, tzinfo=UTC)
    assert due_fire_times(trigger, first, now, 25) == (
        [first] + [first.replace(minute=m) for m in (10, 20, 30)], False)
    assert due_fire_times(trigger, first, now, 2) == (
        [first.replace(minute=20), first.replace(minute=30)], True)
    assert due_fire_times(trigger, first, now, 4)[1] is False
    assert due_fire_times(trigger, first, now, 3) == (
        [first.replace(minute=m) for m in (10, 20, 30)], True)
