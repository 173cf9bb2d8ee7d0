"""The options every schedule takes, stepped through CronLoop.tick with real files:
replace, timeout_s, jitter_s, start_at/end_at, pause_after_failures, notify, catch-up
and backfill."""

from __future__ import annotations

import json
import socket
import sys
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from kandevd.schedules import history as hist
from kandevd.schedules.catchup.backfill import fire_times
from kandevd.schedules.rules.options import NotifySpec, jitter_delay
from kandevd.schedules.sessions.notify import Notifier, notify_event
from kandevd.schedules.workflows.source import next_fire
from kandevd.timeutil import parse_rfc3339, rfc3339, utc_now
from tests.support.workflows import history, schedule, write_workflow
from tests.unit.schedules.test_cron_loop import T0, Agent, folder_of

JOB = "workflow:w:s"


def wait_seen(agent: Agent, count: int = 1) -> None:
    while len(agent.seen) < count:
        threading.Event().wait(0.01)


# -- pure decisions -------------------------------------------------------------------

@given(st.text(min_size=1, max_size=40), st.integers(0, 10 ** 9),
       st.floats(0, 86400, allow_nan=False))
def test_jitter_stays_in_its_window_and_is_fixed_per_fire(key: str, seconds: int,
                                                          jitter: float) -> None:
    intended = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=seconds)
    delay = jitter_delay(key, intended, jitter)
    assert timedelta(0) <= delay <= timedelta(seconds=jitter + 0.001)
    assert delay == jitter_delay(key, intended, jitter)
    if jitter == 0:
        assert delay == timedelta(0)


def test_jitter_spreads_a_thousand_jobs_over_the_window() -> None:
    delays = [jitter_delay(f"workflow:w{i}:s", T0, 600).total_seconds() for i in range(1000)]
    assert min(delays) < 30 and max(delays) > 570
    assert len({int(d // 60) for d in delays}) == 10  # every minute of the window is used


@given(st.sampled_from(["success", "error", "stopped"]), st.integers(0, 5),
       st.sets(st.sampled_from(["failure", "recovery", "success"])), st.booleans())
def test_notify_event(status: str, before: int, on: set[str], paused: bool) -> None:
    event = notify_event(status, before, tuple(on), paused=paused)
    if status == "stopped":
        assert event is None
    elif status == "error":
        assert event == ("paused" if paused else "failure" if "failure" in on else None)
    elif before > 0 and "recovery" in on:
        assert event == "recovery"
    else:
        assert event == ("success" if "success" in on else None)


# -- through the loop -----------------------------------------------------------------

def test_replace_stops_the_running_session_and_starts_the_fire(build, home) -> None:
    write_workflow(home.workspace, "w", [schedule("s", "* * * * *", overlap_policy="replace",
                                                  messages=["a", "b"])])
    gate = threading.Event()
    loop, agent = build(Agent(gate=gate))
    loop.tick(T0 + timedelta(minutes=1))
    wait_seen(agent)
    loop.tick(T0 + timedelta(minutes=2))  # stops the first, keeps this fire
    loop.tick(T0 + timedelta(minutes=3))  # a replacing fire already waits: skipped
    gate.set()
    loop.fanout.join()
    first, second = reversed(history(folder_of(home)))
    assert first["status"] == "stopped"
    assert first["error"] == "stopped: replaced by the fire of 2026-12-03T10:02:00.000000Z"
    assert second["status"] == "success" and second["trigger_source"] == "cron"
    assert loop.registry.resolve("s").state.skipped_overlap == 1


def test_a_session_past_its_timeout_is_stopped_as_an_error(build, home) -> None:
    write_workflow(home.workspace, "w", [schedule("s", messages=["a", "b"], timeout_s=5)])
    gate = threading.Event()
    loop, agent = build(Agent(gate=gate))
    loop.runner.start(loop.registry.resolve("s"), "manual")
    wait_seen(agent)
    assert loop.tick(utc_now()) <= 5  # the loop wakes for the deadline
    loop.tick(utc_now() + timedelta(seconds=6))
    gate.set()
    loop.fanout.join()
    [entry] = history(folder_of(home))
    assert (entry["status"], entry["error"]) == ("error", "timed out after 5s")
    assert len(agent.seen) == 1  # no further turn
    assert loop.registry.resolve("s").state.consecutive_failures == 1


def test_a_jittered_fire_waits_and_records_when_it_was_due(build, home) -> None:
    write_workflow(home.workspace, "w", [schedule("s", "0 11 * * *", jitter_s=600)])
    loop, agent = build()
    due = datetime(2026, 12, 3, 11, tzinfo=UTC)
    delay = jitter_delay(JOB, due, 600)
    assert delay > timedelta(seconds=1)
    wait = loop.tick(due)
    assert agent.seen == [] and 0 < wait <= delay.total_seconds()
    loop.tick(due + delay)
    loop.fanout.join()
    [entry] = history(folder_of(home))
    assert entry["intended_at"] == "2026-12-03T11:00:00.000000Z"
    assert agent.seen[0]["intended_at"] == "2026-12-03T11:00:00.000000Z"


def test_next_run_at_is_when_the_fire_really_starts(build, home) -> None:
    write_workflow(home.workspace, "w", [schedule("s", "0 11 * * *", jitter_s=600)])
    loop, _agent = build()
    due = datetime(2026, 12, 3, 11, tzinfo=UTC)
    job = loop.registry.resolve("s")
    assert job.state.next_fire == due
    assert loop.describe(job)["next_run_at"] == rfc3339(due + jitter_delay(JOB, due, 600))
    loop.tick(due)  # waiting for its jitter: still the same start
    assert loop.describe(job)["next_run_at"] == rfc3339(due + jitter_delay(JOB, due, 600))


def test_a_jittered_fire_pending_at_a_restart_starts_once_at_its_own_time(build,
                                                                          home) -> None:
    write_workflow(home.workspace, "w", [schedule("s", "0 11 * * *", jitter_s=600)])
    due = datetime(2026, 12, 3, 11, tzinfo=UTC)
    start = due + jitter_delay(JOB, due, 600)
    loop, _agent = build(at=due - timedelta(minutes=1))
    loop.tick(due)  # it came due and waits for its jitter; the daemon stops
    loop, agent = build(at=due + (start - due) / 2)
    job = loop.registry.resolve("s")
    assert job.state.delayed_until == start and job.state.missed_while_down == 0
    assert loop.describe(job)["next_run_at"] == rfc3339(start)
    loop.tick(start - timedelta(seconds=1))
    assert agent.seen == []
    loop.tick(start)
    loop.fanout.join()
    [entry] = history(folder_of(home))
    assert (entry["trigger_source"], entry["intended_at"]) == ("cron", rfc3339(due))
    # started, then the daemon stops again: the fire is not run a second time
    loop, agent = build(at=start + timedelta(seconds=1))
    assert loop.registry.resolve("s").state.delayed_until is None
    loop.tick(start + timedelta(seconds=2))
    loop.fanout.join()
    assert agent.seen == [] and len(history(folder_of(home))) == 1


def test_a_jittered_fire_whose_time_fell_while_down_starts_at_its_own_time(build,
                                                                           home) -> None:
    write_workflow(home.workspace, "w", [schedule("s", "0 11 * * *", jitter_s=600)])
    due = datetime(2026, 12, 3, 11, tzinfo=UTC)
    start = due + jitter_delay(JOB, due, 600)
    loop, _agent = build(at=due - timedelta(hours=1))  # down from before its fire time
    loop, _agent = build(at=due + (start - due) / 2)
    job = loop.registry.resolve("s")
    assert (job.state.delayed_until, job.state.missed_while_down) == (start, 0)


def test_a_jittered_fire_whose_start_passed_while_down_is_missed(build, home) -> None:
    write_workflow(home.workspace, "w", [
        schedule("s", "0 11 * * *", jitter_s=600),
        schedule("c", "0 11 * * *", jitter_s=600, catchup_window_s=3600)])
    due = datetime(2026, 12, 3, 11, tzinfo=UTC)
    loop, _agent = build(at=due - timedelta(minutes=1))
    loop.tick(due)  # both wait for their jitter; the daemon stops
    loop, _agent = build(at=due + timedelta(seconds=601))  # their starts passed meanwhile
    plain, caught = loop.registry.resolve("s"), loop.registry.resolve("c")
    assert (plain.state.delayed_until, plain.state.missed_while_down) == (None, 1)
    assert plain.state.catchup is None
    assert caught.state.catchup == [due] and caught.state.missed_while_down == 1
    loop.tick(due + timedelta(seconds=602))
    loop.fanout.join()
    [entry] = history(folder_of(home))
    assert (entry["schedule_id"], entry["trigger_source"], entry["fire_times"]) == (
        "c", "catchup", [rfc3339(due)])


def test_start_at_and_end_at_bound_the_fires_and_end_the_job(build, home) -> None:
    write_workflow(home.workspace, "w", [schedule(
        "s", "0 * * * *", start_at="2026-12-03T12:30:00Z", end_at="2026-12-03T14:00:00Z")])
    loop, _agent = build()
    loop._clock = lambda: T0
    job = loop.registry.resolve("s")
    assert job.state.next_fire == datetime(2026, 12, 3, 13, tzinfo=UTC)
    described = loop.describe(job)
    assert described["state"] == "scheduled" and "begins at" in described["state_reason"]
    assert next_fire(job.spec.schedule, datetime(2026, 12, 3, 14, tzinfo=UTC)) is None
    times = job.source.next_times(job, T0, 5)
    assert times == [datetime(2026, 12, 3, h, tzinfo=UTC) for h in (13, 14)]
    loop._clock = lambda: datetime(2026, 12, 3, 15, tzinfo=UTC)
    ended = loop.describe(job)
    assert (ended["state"], ended["next_run_at"]) == ("ended", None)


def test_repeated_failures_pause_the_job_until_it_is_enabled(build, home) -> None:
    folder = write_workflow(home.workspace, "w", [schedule(
        "s", messages=["FAIL"], pause_after_failures=2)])
    loop, _agent = build()
    for _ in range(2):
        loop.runner.start(loop.registry.resolve("s"), "manual")
        loop.fanout.join()
    job = loop.registry.resolve("s")
    assert job.enabled is False
    assert json.loads((folder / "workflow.json").read_text())["schedules"][0]["enabled"] is False
    described = loop.describe(job)
    assert described["state"] == "disabled"
    assert described["state_reason"].startswith("paused after 2 consecutive failures; last: ")
    job = job.source.set_enabled(job, True, T0)
    assert loop.describe(job)["state"] == "scheduled"


def test_a_failure_notification_runs_the_command_and_is_recorded(build, home,
                                                                 tmp_path: Path) -> None:
    out = tmp_path / "notified.json"
    command = [sys.executable, "-c",
               f"import sys; open({str(out)!r}, 'w').write(sys.stdin.read())"]
    folder = write_workflow(home.workspace, "w", [schedule(
        "s", messages=["FAIL"], notify={"command": command})])
    loop, _agent = build()
    loop.runner.start(loop.registry.resolve("s"), "manual")
    loop.fanout.join()  # the session, then the notification worker
    sent = json.loads(out.read_text())
    assert sent["event"] == "failure" and sent["job_id"] == JOB and sent["status"] == "error"
    [entry] = history(folder)
    assert entry["notified"]["ok"] is True and entry["notified"]["error"] is None
    assert parse_rfc3339(entry["notified"]["at"])


def test_fires_missed_within_the_catchup_window_run_once_at_start(build, home) -> None:
    write_workflow(home.workspace, "w", [schedule("s", "*/10 * * * *",
                                                  catchup_window_s=1800)])
    loop, agent = build()
    loop.tick(T0)  # a daemon watched at 10:00:30, then was down until 11:05
    loop, agent = build(at=T0 + timedelta(minutes=65))
    job = loop.registry.resolve("s")
    assert job.state.missed_while_down == 6
    loop.tick(T0 + timedelta(minutes=65))
    loop.fanout.join()
    [entry] = history(folder_of(home))
    assert entry["trigger_source"] == "catchup"
    assert entry["fire_times"] == [f"2026-12-03T{t}:00.000000Z"
                                   for t in ("10:40", "10:50", "11:00")]
    assert len({s["session_id"] for s in agent.seen}) == 1


def test_a_backfill_runs_each_fire_time_once_in_order(build, home) -> None:
    write_workflow(home.workspace, "w", [schedule("s", "30 2 * * *",
                                                  timezone="Europe/Berlin")])
    loop, agent = build()
    job = loop.registry.resolve("s")
    times = fire_times(job, datetime(2026, 3, 28, tzinfo=UTC), datetime(2026, 3, 30, 12,
                                                                       tzinfo=UTC))
    # across the spring-forward: 02:30 does not exist on the 29th, it fires at 03:00
    assert [t.isoformat() for t in times] == ["2026-03-28T01:30:00+00:00",
                                              "2026-03-29T01:00:00+00:00",
                                              "2026-03-30T00:30:00+00:00"]
    loop.backfills.start(job, times)
    loop.fanout.join()
    entries = list(reversed(history(folder_of(home))))
    assert [e["trigger_source"] for e in entries] == ["backfill"] * 3
    assert [e["intended_at"] for e in entries] == [
        "2026-03-28T01:30:00.000000Z", "2026-03-29T01:00:00.000000Z",
        "2026-03-30T00:30:00.000000Z"]
    sent = {s["session_id"]: s["intended_at"] for s in agent.seen}
    assert [sent[e["session_id"]] for e in entries] == [e["intended_at"] for e in entries]
    assert not loop.backfills.running(JOB)


def test_a_pause_is_announced_with_its_reason(build, home, tmp_path: Path) -> None:
    out = tmp_path / "notified.json"
    command = [sys.executable, "-c",
               f"import sys; open({str(out)!r}, 'w').write(sys.stdin.read())"]
    write_workflow(home.workspace, "w", [schedule(
        "s", messages=["FAIL"], pause_after_failures=1, notify={"command": command})])
    loop, _agent = build()
    loop.runner.start(loop.registry.resolve("s"), "manual")
    loop.fanout.join()
    sent = json.loads(out.read_text())
    assert sent["event"] == "paused"
    assert sent["paused_reason"].startswith("paused after 1 consecutive failures; last: ")


def test_a_jittered_fire_is_dropped_when_the_job_is_switched_off_meanwhile(build,
                                                                           home) -> None:
    write_workflow(home.workspace, "w", [schedule("s", "0 11 * * *", jitter_s=600)])
    loop, agent = build()
    due = datetime(2026, 12, 3, 11, tzinfo=UTC)
    loop.tick(due)  # waiting for its jitter
    job = loop.registry.resolve("s")
    job.source.set_enabled(job, False, due)
    loop.tick(due + timedelta(seconds=601))
    loop.fanout.join()
    assert agent.seen == [] and history(folder_of(home)) == []


def test_catch_up_looks_at_the_newest_missed_fires(build, home) -> None:
    write_workflow(home.workspace, "w", [schedule("s", "* * * * *", catchup_window_s=3600)])
    loop, _agent = build()
    loop.tick(T0)  # a daemon watched, then was down for a day
    loop, _agent = build(at=T0 + timedelta(days=1))
    job = loop.registry.resolve("s")
    assert job.state.catchup is not None and len(job.state.catchup) == 60
    assert job.state.catchup[-1] == datetime(2026, 12, 4, 10, 0, tzinfo=UTC)


def test_a_retried_history_write_never_overwrites_a_newer_one(tmp_path: Path) -> None:
    woken: list[bool] = []
    backlog = hist.PendingWrites(wake=lambda: woken.append(True))
    history_file = hist.History(tmp_path, retention_days=90, backlog=backlog)
    history_file.record_start({"id": "e", "status": "running"}, T0)
    backlog.keep(history_file, "e", {"id": "e", "status": "running", "turns": [1]},
                 OSError(28, "No space left on device"))
    assert woken == [True]  # the cron loop is told to retry soon
    history_file.update_entry("e", {"id": "e", "status": "success"})  # lands: forgets
    backlog.flush()
    [entry] = history_file.entries()
    assert entry["status"] == "success" and "turns" not in entry
    assert len(backlog) == 0


def test_a_webhook_that_answers_garbage_does_not_stop_the_notifier() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def answer_garbage() -> None:
        for _ in range(2):
            conn, _addr = server.accept()
            conn.recv(65536)
            conn.sendall(b"garbage\r\n\r\n")
            conn.close()
    threading.Thread(target=answer_garbage, daemon=True).start()
    notifier = Notifier(lambda _name, work: threading.Thread(target=work).start(),
                        timeout_s=5, retry_after_s=3600)
    outcomes: list[dict[str, Any]] = []
    arrived = threading.Condition()

    def record(outcome: dict[str, Any]) -> None:
        with arrived:
            outcomes.append(outcome)
            arrived.notify_all()
    spec = NotifySpec(webhook=f"http://127.0.0.1:{port}/hook")
    for count in (1, 2):
        notifier.submit("workflow:w:s", spec, "failure", {"id": f"e{count}"}, record)
        with arrived:
            assert arrived.wait_for(lambda c=count: len(outcomes) >= c, 10)
    assert [o["ok"] for o in outcomes] == [False, False]
    notifier.close()
    server.close()
