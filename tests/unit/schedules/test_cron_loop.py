"""CronLoop.tick with an injected clock, real files and a real AgentRuntime.

Sessions run in-process (InProcessRunner) so the fire decision, overlap,
pause and the turn sequence are tested without child processes.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kandevd.app.scheduler import build_registry
from kandevd.config import build_config
from kandevd.lifecycle import FanOut
from kandevd.paths import HomeLayout
from kandevd.runtime import AgentRuntime, ExecutionSpec, InProcessRunner
from kandevd.schedules.firing import Decision, Firing, decide_fire
from kandevd.schedules.history import SHUTDOWN_ERROR
from kandevd.schedules.loop import CronLoop
from kandevd.schedules.rules.options import jitter_delay
from kandevd.schedules.rules.states import paused_after_failures
from kandevd.schedules.sessions.runner import SessionRunner
from kandevd.schedules.settings import Switches
from kandevd.timeutil import parse_rfc3339, rfc3339
from tests.support.workflows import history, schedule, write_workflow

T0 = datetime(2026, 12, 3, 10, 0, 30, tzinfo=UTC)


@dataclass
class Agent:
    """An in-process agent: records each stdin; a message containing FAIL fails;
    ``gate`` (when set) makes every turn wait for it."""

    seen: list[dict[str, Any]] = field(default_factory=list)
    gate: threading.Event | None = None
    #: The events the session runner published (schedule.*), in order.
    told: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, spec: ExecutionSpec) -> tuple[int, str | None, float | None]:
        with self.lock:
            self.seen.append(dict(spec.stdin))
        if self.gate is not None:
            self.gate.wait(30)
        return (1 if "FAIL" in spec.stdin.get("message", "") else 0), "ok", 2


@pytest.fixture
def home(tmp_path: Path) -> HomeLayout:
    return HomeLayout(tmp_path)


@pytest.fixture
def build(home: HomeLayout) -> Iterator[Callable[..., tuple[CronLoop, Agent]]]:
    made: list[tuple[CronLoop, AgentRuntime]] = []

    def make(agent: Agent | None = None, *, env: dict[str, str] | None = None,
             max_concurrent: int = 4, at: datetime = T0) -> tuple[CronLoop, Agent]:
        agent = agent or Agent()
        config = build_config({"runtime": {"max_concurrent": max_concurrent}},
                              environ=env or {})
        runtime = AgentRuntime(max_concurrent, 1, runner=InProcessRunner(agent))
        registry = build_registry(home.workspace,
                                  Switches.from_config(config.scheduler, env or {}), 90)
        registry.load_at_start(at)

        fanout = FanOut("cron", logging.getLogger("kandevd.scheduler"))
        firing = Firing(registry)
        told: list[tuple[str, dict[str, Any]]] = []
        runner = SessionRunner(registry, config=config, layout=home, runtime=runtime,
                               spawn=fanout.spawn, firing=firing,
                               publish=lambda topic, data: told.append((topic, dict(data))))
        agent.told = told
        loop = CronLoop(registry, runner=runner, firing=firing, stop_grace_s=0, fanout=fanout)
        made.append((loop, runtime))
        return loop, agent

    yield make
    for loop, runtime in made:
        loop.runner.close(0)
        loop.fanout.join()
        runtime.stop()


def folder_of(home: HomeLayout, name: str = "w") -> Path:
    return home.workspace / "Workflow" / name


# -- the decision ----------------------------------------------------------------------

@given(st.booleans(), st.booleans(), st.booleans(), st.booleans(), st.booleans(),
       st.sampled_from(["skip", "buffer_one", "replace"]))
def test_decide_fire_policy(enabled: bool, allowed: bool, paused: bool, running: bool,
                            buffered: bool, policy: str) -> None:
    decision = decide_fire(execution_enabled=enabled, workflow_allowed=allowed, paused=paused,
                           running=running, buffered=buffered, overlap_policy=policy)
    if not (enabled and allowed):
        assert decision is Decision.SKIP_DISABLED
    elif paused:
        assert decision is Decision.SKIP_PAUSED
    elif not running:
        assert decision is Decision.RUN
    elif policy == "buffer_one" and not buffered:
        assert decision is Decision.BUFFER
    elif policy == "replace" and not buffered:
        assert decision is Decision.REPLACE
    else:
        assert decision is Decision.SKIP_OVERLAP


# -- ticks -----------------------------------------------------------------------------

def test_nothing_fires_before_the_time_and_the_wait_points_at_it(build, home) -> None:
    write_workflow(home.workspace, "w", [schedule("s", "*/5 * * * *")])
    loop, agent = build()
    assert loop.tick(T0) == 60  # capped, so a wall-clock change is noticed
    assert loop.tick(datetime(2026, 12, 3, 10, 4, 45, tzinfo=UTC)) == 15
    assert loop.fires == 0 and agent.seen == []


def test_a_due_fire_runs_one_cron_session_and_a_late_tick_replays_nothing(build, home) -> None:
    write_workflow(home.workspace, "w", [schedule("s", "*/5 * * * *")])
    loop, _agent = build()
    loop.tick(T0 + timedelta(hours=1))  # twelve fire times passed: one fire
    loop.fanout.join()
    assert loop.fires == 1
    [entry] = history(folder_of(home))
    assert entry["trigger_source"] == "cron" and entry["status"] == "success"
    job = loop.registry.resolve("s")
    assert job.state.next_fire == datetime(2026, 12, 3, 11, 5, tzinfo=UTC)
    assert job.state.run_count == 1 and job.state.last_status == "success"


def test_paused_and_disabled_fires_are_counted_not_run(build, home) -> None:
    write_workflow(home.workspace, "w", [schedule("s", "* * * * *")])
    loop, agent = build()
    loop.registry.pause.put(True, "ops", T0)
    loop.tick(T0 + timedelta(minutes=1))
    assert loop.registry.resolve("s").state.skipped_paused == 1
    off, _ = build(env={"SCHEDULER_ENABLED": "false"})
    off.tick(T0 + timedelta(minutes=1))
    assert off.registry.resolve("s").state.skipped_disabled == 1
    blocked, _ = build(env={"SCHEDULER_BLOCKED_WORKFLOWS": "W"})
    blocked.tick(T0 + timedelta(minutes=1))
    job = blocked.registry.resolve("s")
    assert job.state.skipped_disabled == 1
    assert blocked.registry.ineligible_reason(job, paused=False) == \
        "workflow blocked by the block list (W)"
    assert agent.seen == [] and history(folder_of(home)) == []


@pytest.mark.parametrize(("policy", "sessions", "skipped"), [("skip", 1, 2),
                                                             ("buffer_one", 2, 1)])
def test_overlap_policies(build, home, policy: str, sessions: int, skipped: int) -> None:
    write_workflow(home.workspace, "w", [schedule("s", "* * * * *", overlap_policy=policy)])
    gate = threading.Event()
    loop, _agent = build(Agent(gate=gate))
    for minute in (1, 2, 3):
        loop.tick(T0 + timedelta(minutes=minute))
    job = loop.registry.resolve("s")
    assert job.state.skipped_overlap == skipped
    gate.set()
    loop.fanout.join()
    entries = history(folder_of(home))
    assert len(entries) == sessions
    assert all(e["status"] == "success" and e["trigger_source"] == "cron" for e in entries)


def test_fires_and_sessions_are_told_to_the_daemons_subscribers(build, home) -> None:
    write_workflow(home.workspace, "w", [schedule("s", "* * * * *", overlap_policy="skip",
                                                  messages=["hi", "FAIL"],
                                                  pause_after_failures=1)])
    gate = threading.Event()
    loop, agent = build(Agent(gate=gate))
    loop.tick(T0 + timedelta(minutes=1))
    loop.tick(T0 + timedelta(minutes=2))
    gate.set()
    loop.fanout.join()
    [entry] = history(folder_of(home))
    topics = [(topic, data.get("status")) for topic, data in agent.told]
    assert topics == [("schedule.fired", "started"),
                      ("schedule.session_started", "running"),
                      ("schedule.fired", "skipped_overlap"),
                      ("schedule.session_ended", "error"),
                      ("schedule.paused", "paused")]
    fired, started, skipped, ended, paused = (data for _topic, data in agent.told)
    job = loop.registry.resolve("s").key
    assert started == {"id": job, "entry_id": entry["id"], "status": "running",
                       "trigger_source": "cron"}
    assert fired["id"] == skipped["id"] == ended["id"] == paused["id"] == job
    assert fired["entry_id"] == entry["id"] == ended["entry_id"] == paused["entry_id"]
    assert skipped["entry_id"] is None
    assert fired["intended_at"] == "2026-12-03T10:01:00.000000Z"
    assert "paused after 1 consecutive failure" in paused["reason"]


# -- the session -----------------------------------------------------------------------

def run_manual(loop: CronLoop, job_id: str = "s") -> None:
    loop.runner.start(loop.registry.resolve(job_id), "manual")
    loop.fanout.join()


def test_turn_sequence_preflight_messages_reports_and_pulse(build, home) -> None:
    folder = write_workflow(home.workspace, "w", [schedule(
        "s", group_ids=["g1", "g2", "off"], messages=["one", "two"], pulse=True,
        trigger_payload={"k": 1})], groups={"g1": True, "g2": True, "off": False},
        pending_upgrades=["x"])
    (folder / "decisions.json").write_text(json.dumps([
        {"id": 1, "question": "q", "answer": "a", "status": "answered"},
        {"id": 2, "question": "q2", "answer": None, "status": "open"}]))
    loop, agent = build()
    run_manual(loop)
    kinds = [(s["turn"]["kind"], s["message"][:20], s["workshop_mode"],
              s["execution_options"]["selected_run_folder"]) for s in agent.seen]
    assert kinds == [
        ("preflight", "Apply the answered d", "workshop", "iteration-0"),
        ("message", "one", "run", "iteration-0"),
        ("message", "two", "run", "iteration-0"),
        ("report", "Generate the final r", "run", "iteration-0/g1"),
        ("report", "Generate the final r", "run", "iteration-0/g2"),
        ("pulse", "Pulse: scheduled run", "workshop", "iteration-0"),
    ]
    first = agent.seen[0]
    assert first["decisions"] == [{"id": 1, "question": "q", "answer": "a",
                                   "status": "answered"}]
    assert first["execution_options"]["contract_upgrades_pending"] is True
    assert first["execution_options"]["enabled_group_ids"] == ["g1", "g2"]
    assert first["payload"] == {"k": 1} and first["triggered_by"] == "manual"
    assert (first["agent_mode"], first["phase_id"]) == ("workflow_phase", "workflow-builder")
    [entry] = history(folder)
    assert entry["status"] == "success" and entry["cost_cents"] == 12
    assert [t["kind"] for t in entry["turns"]] == ["preflight", "message", "message",
                                                   "report", "report", "pulse"]
    assert agent.seen[-1]["message"].find(entry["id"]) > 0
    decisions = json.loads((folder / "decisions.json").read_text())
    assert decisions[0]["status"] == "applied"
    assert decisions[0]["applied_session_id"] == entry["session_id"]
    assert decisions[1]["status"] == "open"
    assert (folder / "runs" / "iteration-0" / "g2").is_dir()


def test_a_failing_message_ends_the_session_and_sends_nothing_more(build, home) -> None:
    folder = write_workflow(home.workspace, "w", [schedule(
        "s", messages=["one", "FAIL two", "three"], pulse=True)])
    loop, agent = build()
    run_manual(loop)
    assert [s["message"] for s in agent.seen][:2] == ["one", "FAIL two"]
    assert agent.seen[2]["turn"]["kind"] == "pulse" and len(agent.seen) == 3
    [entry] = history(folder)
    assert entry["status"] == "error"
    assert entry["error"] == "message turn 2 failed: exit code 1"
    assert loop.registry.resolve("s").state.consecutive_failures == 1


def test_no_report_when_a_message_runs_the_report_itself(build, home) -> None:
    write_workflow(home.workspace, "w", [schedule("s", messages=["do run_full_report now"])])
    loop, agent = build()
    run_manual(loop)
    assert [s["turn"]["kind"] for s in agent.seen] == ["message"]


def test_default_message_and_workshop_mode_without_report(build, home) -> None:
    write_workflow(home.workspace, "w", [schedule("s", workshop_mode="workshop")])
    loop, agent = build()
    run_manual(loop)
    assert [(s["turn"]["kind"], s["message"]) for s in agent.seen] == [
        ("message", "Run the full workflow using run_full_workflow tool.")]


def test_closing_records_the_session_in_flight_as_stopped(build, home) -> None:
    folder = write_workflow(home.workspace, "w", [schedule("s", messages=["a", "b"])])
    gate = threading.Event()
    loop, agent = build(Agent(gate=gate))
    loop.runner.start(loop.registry.resolve("s"), "manual")
    while not agent.seen:
        gate.wait(0.01)
    loop.runner.close(0)
    gate.set()  # an in-process turn cannot be interrupted: it ends, no further turn starts
    loop.fanout.join()
    [entry] = history(folder)
    assert entry["status"] == "stopped" and entry["error"] == SHUTDOWN_ERROR
    assert len(agent.seen) == 1


def test_a_buffered_fire_is_decided_again_when_it_may_start(build, home) -> None:
    write_workflow(home.workspace, "w", [schedule("s", "* * * * *",
                                                  overlap_policy="buffer_one")])
    gate = threading.Event()
    loop, agent = build(Agent(gate=gate))
    loop.tick(T0 + timedelta(minutes=1))
    loop.tick(T0 + timedelta(minutes=2))  # buffered behind the running session
    assert loop.runner.is_buffered("workflow:w:s")
    loop.registry.pause.put(True, "ops", T0)  # paused while it waits
    gate.set()
    loop.fanout.join()
    assert len(history(folder_of(home))) == 1
    assert len({s["session_id"] for s in agent.seen}) == 1
    assert loop.registry.resolve("s").state.skipped_paused == 1


def test_a_session_that_stops_by_request_says_so(build, home) -> None:
    write_workflow(home.workspace, "w", [schedule("s", messages=["a", "b"])])
    gate = threading.Event()
    loop, agent = build(Agent(gate=gate))
    loop.runner.start(loop.registry.resolve("s"), "manual")
    while not agent.seen:
        gate.wait(0.01)
    loop.runner.stop("workflow:w:s")
    gate.set()
    loop.fanout.join()
    [entry] = history(folder_of(home))
    assert entry["status"] == "stopped" and entry["error"] == "stopped: scheduler.jobs.stop"


def write_product(root: Path, schedules: list[dict[str, Any]]) -> None:
    folder = root / "products" / "helper"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "product.yaml").write_text(json.dumps({"profile": {
        "runtime": {"conversation": {"mode": "singleton"}}, "schedules": schedules}}))


def test_a_cadence_product_schedule_fires_under_an_injected_clock(build, home) -> None:
    write_product(home.workspace, [{"id": "every2h", "cadence_hours": 2,
                                    "messages": ["hello"]}])
    loop, agent = build()
    [job] = loop.registry.jobs(source="products")
    loop.tick(T0)  # first sight: not due, the first slot is written down
    assert agent.seen == [] and job.state.next_fire == T0 + timedelta(hours=2)
    state_file = home.workspace / "_users" / "local" / "chat_history" / \
        "product-schedules.json"
    assert json.loads(state_file.read_text())["schedules"]["helper:every2h"]["next_run_at"]
    loop.tick(T0 + timedelta(hours=1))
    assert agent.seen == []
    loop.tick(T0 + timedelta(hours=2, seconds=1))
    loop.fanout.join()
    assert [s["message"] for s in agent.seen] == ["hello"]
    assert agent.seen[0]["triggered_by"] == "cron" and agent.seen[0]["user_id"] == "local"
    assert job.state.run_count == 1 and job.state.last_status == "success"
    loop.tick(T0 + timedelta(hours=2, seconds=2))  # the occurrence is spent: no second run
    loop.fanout.join()
    assert len(agent.seen) == 1
    # the next slot is two hours after the run began (sessions keep real time)
    assert job.state.next_fire == parse_rfc3339(job.state.last_run_at) + timedelta(hours=2)


def test_a_reload_picks_up_a_changed_product_and_user_directory(build, home) -> None:
    write_product(home.workspace, [{"id": "a", "cadence_hours": 1, "messages": ["m"]}])
    loop, _agent = build()
    assert [j.user_id for j in loop.registry.jobs(source="products")] == ["local"]
    write_product(home.workspace, [{"id": "a", "cadence_hours": 1, "messages": ["m"]},
                                   {"id": "b", "cron_expression": "0 8 * * *",
                                    "messages": ["m"]}])
    (home.workspace / "users.yaml").write_text("- {id: ann, enabled: true, products: '*'}\n")
    result = loop.registry.rescan(T0)
    assert result["product_jobs"] == 2
    assert [(j.id, j.user_id) for j in loop.registry.jobs(source="products")] == [
        ("product:helper:a", "ann"), ("product:helper:b", "ann")]


def test_a_cron_product_occurrence_missed_while_down_is_not_replayed(build, home) -> None:
    write_product(home.workspace, [{"id": "daily", "cron_expression": "0 8 * * *",
                                    "messages": ["m"]}])
    state = home.workspace / "_users" / "local" / "chat_history" / "product-schedules.json"
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps({"schedules": {"helper:daily": {
        "next_run_at": "2026-12-03T08:00:00.000000Z"}}}))  # before T0: passed while down
    loop, agent = build()
    loop.tick(T0)
    loop.fanout.join()
    [job] = loop.registry.jobs(source="products")
    assert agent.seen == []
    assert job.state.next_fire == datetime(2026, 12, 4, 8, tzinfo=UTC)


def minutely_product_left_at(home: HomeLayout, pending: str, **stored: object) -> None:
    write_product(home.workspace, [{"id": "minutely", "cron_expression": "* * * * *",
                                    "catchup_window_s": 150, "messages": ["m"]}])
    state = home.workspace / "_users" / "local" / "chat_history" / "product-schedules.json"
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps({"schedules": {"helper:minutely": {
        "next_run_at": pending, **stored}}}))


def test_product_occurrences_missed_while_down_are_counted_as_a_workflows_fires(
        build, home) -> None:
    """Every occurrence whose time fell while no daemon ran counts (not only the pending
    one), and those within catchup_window_s are named by the one catch-up run."""
    minutely_product_left_at(home, "2026-12-03T09:57:00.000000Z")  # T0 is 10:00:30
    loop, agent = build()
    [job] = loop.registry.jobs(source="products")
    assert job.state.missed_while_down == 4  # 09:57, 09:58, 09:59, 10:00
    assert job.state.catchup == [datetime(2026, 12, 3, 9, 58, tzinfo=UTC),
                                 datetime(2026, 12, 3, 9, 59, tzinfo=UTC),
                                 datetime(2026, 12, 3, 10, 0, tzinfo=UTC)]
    loop.tick(T0)
    loop.fanout.join()
    assert [s["triggered_by"] for s in agent.seen] == ["catchup"]


def test_a_product_job_its_user_turned_off_misses_nothing_while_down(
        build, home, caplog) -> None:
    caplog.set_level("INFO", logger="kandevd.scheduler.products")
    minutely_product_left_at(home, "2026-12-03T09:57:00.000000Z", enabled=False)
    loop, agent = build()
    [job] = loop.registry.jobs(source="products")
    assert job.state.missed_while_down == 0 and job.state.catchup is None
    assert not [r for r in caplog.records if "missed while the daemon was down" in r.message]
    loop.tick(T0)
    loop.fanout.join()
    assert agent.seen == []


def test_an_impossible_stored_time_never_stalls_the_tick(build, home) -> None:
    write_product(home.workspace, [{"id": "c", "cadence_hours": 1, "preferred_hour": 3,
                                    "messages": ["m"]}])
    write_workflow(home.workspace, "w", [schedule("s", "* * * * *")])
    state = home.workspace / "_users" / "local" / "chat_history" / "product-schedules.json"
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps({"schedules": {"helper:c": {
        "last_run_at": "9999-12-31T22:00:00Z", "last_status": "error",
        "consecutive_failures": 10}}}))
    loop, _agent = build()
    loop.tick(T0 + timedelta(minutes=1))  # raises nothing; the workflow still fires
    loop.fanout.join()
    assert loop.registry.resolve("s").state.run_count == 1


def test_a_quiet_rule_hold_is_shown_logged_and_survives_a_restart(build, home, caplog) -> None:
    write_product(home.workspace, [{"id": "daily", "cron_expression": "0 11 * * *",
                                    "quiet_minutes": 60, "messages": ["m"]}])
    caplog.set_level("INFO", logger="kandevd.scheduler.products")
    loop, agent = build()
    loop.tick(T0)  # the pending occurrence: 11:00
    loop.registry.sources["products"].record_activity(
        "local", "helper", datetime(2026, 12, 3, 10, 30, tzinfo=UTC))
    at_eleven = datetime(2026, 12, 3, 11, 0, 30, tzinfo=UTC)
    loop.tick(at_eleven)
    [job] = loop.registry.jobs(source="products")
    held_until = datetime(2026, 12, 3, 11, 30, tzinfo=UTC)
    assert agent.seen == [] and job.state.held_until == held_until
    described = loop.describe(job)
    assert (described["state"], described["held_until"], described["next_run_at"]) == (
        "held", "2026-12-03T11:30:00.000000Z", "2026-12-03T11:30:00.000000Z")
    assert described["last_activity_at"] == "2026-12-03T10:30:00.000000Z"
    started = [r.message for r in caplog.records if "held by the quiet rule" in r.message]
    assert len(started) == 1 and "fires at 2026-12-03T11:30:00" in started[0]
    loop.tick(at_eleven + timedelta(minutes=1))  # still held: no second line
    assert sum("held by the quiet rule" in r.message for r in caplog.records) == 1

    # a restart: the daemon saw the occurrence come due, so it is not "missed"
    loop, agent = build(at=at_eleven + timedelta(minutes=5))
    [job] = loop.registry.jobs(source="products")
    assert job.state.missed_while_down == 0
    assert job.state.next_fire == datetime(2026, 12, 3, 11, tzinfo=UTC)
    loop.tick(at_eleven + timedelta(minutes=5))
    assert loop.describe(job)["state"] == "held" and job.state.held_until == held_until
    loop.tick(held_until + timedelta(seconds=1))
    loop.fanout.join()
    assert [s["message"] for s in agent.seen] == ["m"]
    assert any("hold ended (the quiet period is over)" in r.message for r in caplog.records)
    assert job.state.held_until is None and loop.describe(job)["state"] == "scheduled"


def test_an_occurrence_that_fell_while_down_is_counted_missed_once(build, home) -> None:
    write_product(home.workspace, [{"id": "daily", "cron_expression": "0 11 * * *",
                                    "messages": ["m"]}])
    loop, agent = build()
    loop.tick(T0)  # the daemon last watched at 10:00:30; 11:00 falls while it is down
    loop, agent = build(at=T0 + timedelta(hours=3))
    [job] = loop.registry.jobs(source="products")
    loop.tick(T0 + timedelta(hours=3))
    loop.fanout.join()
    assert agent.seen == [] and job.state.missed_while_down == 1
    assert job.state.next_fire == datetime(2026, 12, 4, 11, tzinfo=UTC)


def test_a_jittered_product_occurrence_whose_start_is_ahead_survives_a_restart(
        build, home) -> None:
    write_product(home.workspace, [{"id": "daily", "cron_expression": "0 11 * * *",
                                    "jitter_s": 3600, "messages": ["m"]}])
    eleven = datetime(2026, 12, 3, 11, tzinfo=UTC)
    start = eleven + jitter_delay("product:helper:daily@local", eleven, 3600)
    loop, agent = build()
    loop.tick(T0)  # the daemon last watched at 10:00:30; 11:00 falls while it is down
    loop, agent = build(at=eleven + (start - eleven) / 2)  # back before its start
    [job] = loop.registry.jobs(source="products")
    assert job.state.missed_while_down == 0 and job.state.next_fire == eleven
    assert loop.describe(job)["next_run_at"] == rfc3339(start)
    loop.tick(eleven + (start - eleven) / 2)
    assert agent.seen == []
    loop.tick(start)
    loop.fanout.join()
    assert [s["message"] for s in agent.seen] == ["m"]


def test_a_retry_resumes_at_the_message_that_failed(build, home) -> None:
    write_product(home.workspace, [{"id": "c", "cadence_hours": 1,
                                    "messages": ["one", "FAIL two", "three"]}])
    agent = Agent()
    loop, _ = build(agent)
    [job] = loop.registry.jobs(source="products")
    loop.runner.start(job, "manual")
    loop.fanout.join()
    assert [s["message"] for s in agent.seen] == ["one", "FAIL two"]
    assert job.state.resume == {"index": 1, "message": "FAIL two"}
    # the next run (a rebuilt daemon: the resume point is in the user's state file)
    loop, _ = build(agent)
    [job] = loop.registry.jobs(source="products")
    loop.runner.start(job, "manual")
    loop.fanout.join()
    assert [s["message"] for s in agent.seen[2:]] == ["FAIL two"]
    [newest, _first] = loop.registry.sources["products"].history(job).entries()[:2]
    assert newest["first_message"] == 1


def test_each_tick_marks_the_root_as_watched(build, home) -> None:
    loop, _agent = build()
    loop.tick(T0 + timedelta(minutes=7))
    assert loop.registry.alive.last_seen() == T0 + timedelta(minutes=7)


def test_a_product_job_fixed_after_being_invalid_is_decided_again(build, home) -> None:
    write_product(home.workspace, [{"id": "daily", "cron_expression": "0 11 * * *",
                                    "messages": ["m"]}])
    loop, _agent = build()
    loop.tick(T0)
    [job] = loop.registry.jobs(source="products")
    product_file = home.workspace / "products" / "helper" / "product.yaml"
    good = product_file.read_text()
    product_file.write_text("profile: [")
    loop.registry.rescan(T0 + timedelta(minutes=1))
    loop.tick(T0 + timedelta(minutes=1))
    assert loop.describe(job)["state"] == "invalid"
    product_file.write_text(good)
    loop.registry.rescan(T0 + timedelta(minutes=2))
    loop.tick(T0 + timedelta(minutes=2))
    [job] = loop.registry.jobs(source="products")
    described = loop.describe(job)
    assert described["state"] == "scheduled"
    assert described["next_run_at"] == "2026-12-03T11:00:00.000000Z"


def test_a_workflow_jobs_carry_its_label_and_a_reload_follows_it(build, home) -> None:
    folder = write_workflow(home.workspace, "w", [schedule("s")], label="Daily digest")
    write_workflow(home.workspace, "plain", [schedule("t")])
    loop, _agent = build()
    described = {job.key: loop.describe(job) for job in loop.registry.jobs()}
    assert described["workflow:w:s"]["workflow_label"] == "Daily digest"
    assert described["workflow:plain:t"]["workflow_label"] is None
    manifest = json.loads((folder / "workflow.json").read_text())
    (folder / "workflow.json").write_text(json.dumps({**manifest, "label": "Digest"}))
    loop.registry.rescan(T0)
    assert loop.describe(loop.registry.resolve("workflow:w:s"))["workflow_label"] == "Digest"


def test_a_new_leader_fires_what_no_leader_fired_and_a_pause_still_wins(build, home) -> None:
    write_workflow(home.workspace, "w", [schedule("s", "* * * * *")])
    took_over = T0 + timedelta(minutes=3, seconds=30)
    paused, _ = build()
    paused.fire_gate = lambda _key, _intended: True  # several daemons: this one leads
    paused.registry.pause.put(True, "ops", T0)
    paused.request_late_fires(T0 + timedelta(seconds=30))  # the last lease renewal seen
    paused.tick(took_over)
    assert paused.late_fires == 0  # the fire policy said no: nothing owed is run
    paused.registry.pause.put(False, None, T0)  # (the pause file is the home's)
    loop, _agent = build()
    loop.fire_gate = lambda _key, _intended: True
    loop.request_late_fires(T0 + timedelta(seconds=30))
    loop.tick(took_over)
    loop.fanout.join()
    # 10:01 to 10:04, none fired by any leader: run now, one after the other, as "cron"
    assert loop.late_fires == 4 and loop.late_max_s == 180.0
    entries = history(folder_of(home))
    assert sorted(datetime.fromisoformat(e["intended_at"]) for e in entries
                  if e.get("intended_at")) == [
        datetime(2026, 12, 3, 10, minute, tzinfo=UTC) for minute in range(1, 5)]


def test_a_pause_after_failures_its_manifest_cannot_say_still_holds_the_job_off(
        build, home, caplog: pytest.LogCaptureFixture) -> None:
    """workflow.json cut short by hand while a failing session ran: the pause cannot be
    written, so the job is held off in memory (it would fail unattended), told as a
    pause, and `jobs enable` once the file is fixed lets it fire again."""
    write_workflow(home.workspace, "w", [schedule("s", "* * * * *", messages=["FAIL"],
                                                  pause_after_failures=1)])
    manifest = folder_of(home) / "workflow.json"
    whole = manifest.read_text()
    gate = threading.Event()
    loop, agent = build(Agent(gate=gate))
    loop.tick(T0 + timedelta(minutes=1))
    manifest.write_text(whole[:40])
    with caplog.at_level(logging.ERROR, logger="kandevd.scheduler"):
        gate.set()
        loop.fanout.join()
    assert "but its file could not say so" in caplog.text
    assert ("schedule.paused", "paused") in [(t, d.get("status")) for t, d in agent.told]
    assert manifest.read_text() == whole[:40]  # (the operator's to fix: left as it is)
    job = loop.registry.resolve("s")
    assert not job.enabled
    loop.tick(T0 + timedelta(minutes=2))
    loop.fanout.join()
    assert len(agent.seen) == 1 and job.state.next_fire is None
    assert "paused after 1 consecutive failure" in (paused_after_failures(job) or "")
    # Fixed and reloaded: still held (the file says enabled, the pause was never written).
    manifest.write_text(whole)
    loop.registry.rescan(T0 + timedelta(minutes=2, seconds=10))
    job = loop.registry.resolve("s")
    assert not job.enabled and job.state.next_fire is None
    loop.tick(T0 + timedelta(minutes=3))
    job = job.source.set_enabled(job, True, T0 + timedelta(minutes=3, seconds=10))
    assert job.enabled and job.state.enabled is None
    loop.tick(T0 + timedelta(minutes=4))
    loop.fanout.join()
    assert len(agent.seen) == 2


def test_a_schedule_created_again_is_seeded_from_its_history(build, home) -> None:
    """jobs delete then jobs create of the same id: its runs so far count again, as when
    the schedule is added by hand and reloaded (or at a restart)."""
    write_workflow(home.workspace, "w", [schedule("s", "0 3 * * *", messages=["FAIL"])])
    loop, _agent = build()
    run_manual(loop)
    job = loop.registry.resolve("s")
    assert (job.state.run_count, job.state.consecutive_failures) == (1, 1)
    definition = {k: v for k, v in json.loads(
        (folder_of(home) / "workflow.json").read_text())["schedules"][0].items()}
    assert job.source.change(job, None, T0) is None
    created = job.source.create("w", definition, T0)
    assert (created.state.run_count, created.state.consecutive_failures,
            created.state.last_status) == (1, 1, "error")
    assert created.state.next_fire is not None


def test_a_new_leader_reads_what_the_previous_one_wrote_before_it_fires(build, home) -> None:
    """Two daemons on one root: the leader's failures and the pause it wrote into
    workflow.json were never told to the other, which would go on counting from its
    own start and fire the paused job once it leads."""
    write_workflow(home.workspace, "w", [schedule("s", "* * * * *", messages=["FAIL"],
                                                  pause_after_failures=2)])
    first, _ = build()
    second, _ = build()  # (both loaded at T0)
    first.tick(T0 + timedelta(seconds=30))  # 10:01: fails (1)
    first.fanout.join()
    second.request_late_fires(None)  # the first stepped down; the second leads
    second.tick(T0 + timedelta(seconds=90))  # 10:02: fails (2): paused
    second.fanout.join()
    assert [e["status"] for e in history(folder_of(home))] == ["error", "error"]
    job = second.registry.resolve("workflow:w:s")
    assert job.state.consecutive_failures == 2
    assert json.loads((folder_of(home) / "workflow.json").read_text())[
        "schedules"][0]["enabled"] is False

    first.request_late_fires(None)  # the first leads again: the job is paused
    first.tick(T0 + timedelta(seconds=150))  # 10:03
    first.fanout.join()
    assert len(history(folder_of(home))) == 2
    again = first.registry.resolve("workflow:w:s")
    assert (again.state.consecutive_failures, again.state.last_status) == (2, "error")


def test_a_new_leader_takes_a_product_jobs_state_as_the_previous_one_stored_it(
        build, home) -> None:
    write_product(home.workspace, [{"id": "every2h", "cadence_hours": 2,
                                    "messages": ["FAIL"], "pause_after_failures": 1}])
    first, _ = build()
    second, _ = build()
    first.tick(T0)  # the first slot, written down
    first.tick(T0 + timedelta(hours=2, seconds=1))  # fails: paused (the user's state)
    first.fanout.join()
    [paused] = first.registry.jobs(source="products")
    assert (paused.state.enabled, paused.state.consecutive_failures) == (False, 1)
    second.request_late_fires(None)
    second.tick(T0 + timedelta(hours=4, seconds=2))
    second.fanout.join()
    [job] = second.registry.jobs(source="products")
    assert (job.state.enabled, job.state.consecutive_failures, job.state.run_count,
            job.state.last_status) == (False, 1, 1, "error")
    assert second.fires == 0  # (a paused job: nothing was due)
