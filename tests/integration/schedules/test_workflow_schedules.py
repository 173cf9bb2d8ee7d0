"""The file-backed workflow scheduler through the real daemon, real files and a real
subprocess agent (tests/support/agents/recorder.py)."""

from __future__ import annotations

import itertools
import json
import signal
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from kandevd.control.client import RpcCallError
from kandevd.cron import next_fire_times, parse_cron
from kandevd.timeutil import rfc3339, utc_now
from tests.support.daemon import DaemonProcess, run_cli
from tests.support.workflows import (
    history,
    recorder_config,
    records,
    schedule,
    write_workflow,
)

pytestmark = pytest.mark.integration


def terminal(daemon: DaemonProcess, job_id: str, count: int = 1, timeout: float = 30
             ) -> list[dict[str, Any]]:
    """Wait until ``job_id`` has ``count`` history entries, none running; newest first."""
    def done() -> list[dict[str, Any]] | None:
        page = daemon.call("scheduler.jobs.runs", {"id": job_id})
        items = page["items"]
        if len(items) >= count and all(e["status"] != "running" for e in items):
            return items
        return None
    return daemon.wait_until(done, what=f"{count} finished run(s) of {job_id}",
                             timeout=timeout)


def started_turns(daemon: DaemonProcess, job_id: str) -> list[dict[str, Any]]:
    """The turns of the newest session of ``job_id`` that the history shows started."""
    items = daemon.call("scheduler.jobs.runs", {"id": job_id, "limit": 1})["items"]
    return items[0]["turns"] if items else []


@pytest.fixture
def setup(tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]
          ) -> Callable[..., tuple[DaemonProcess, Path]]:
    def make(workflows: dict[str, list[dict[str, Any]]], *, env: dict[str, str] | None = None,
             start: bool = True, **runtime: Any) -> tuple[DaemonProcess, Path]:
        home = tmp_path / "home"
        for name, schedules in workflows.items():
            write_workflow(home / "workspace", name, schedules, groups=("g1", "g2"))
        record = tmp_path / "record.jsonl"
        daemon = daemon_factory(recorder_config(record, **runtime), env=env, start=start)
        return daemon, record
    return make


def test_trigger_runs_messages_in_order_and_records_the_session(setup) -> None:
    daemon, record = setup({"reports": [schedule(
        "daily", group_ids=["g1", "g2"], messages=["first", "second"],
        trigger_payload={"topic": "x"})]})
    answer = daemon.call("scheduler.jobs.trigger", {"id": "daily"})
    assert answer["id"] == "workflow:reports:daily"
    [entry] = terminal(daemon, "daily")
    assert entry["status"] == "success" and entry["trigger_source"] == "manual"
    assert entry["session_id"] == answer["session_id"] and entry["id"] == answer["run_id"]
    assert [t["kind"] for t in entry["turns"]] == ["message", "message", "report", "report"]
    assert entry["cost_cents"] == 12
    for turn in entry["turns"]:
        assert Path(turn["log_path"]).is_file() and turn["status"] == "success"
    seen = records(record)
    assert [r["stdin"]["message"] for r in seen[:2]] == ["first", "second"]
    for earlier, later in itertools.pairwise(seen):
        assert earlier["end"] <= later["start"]  # each turn after the previous exited
    workflow_runs = daemon.home / "workspace" / "Workflow" / "reports" / "runs"
    assert seen[0]["cwd"] == str(workflow_runs / "iteration-0")
    assert [r["cwd"] for r in seen[2:]] == [str(workflow_runs / "iteration-0" / g)
                                            for g in ("g1", "g2")]
    first = seen[0]["stdin"]
    assert first["kind"] == "turn" and first["triggered_by"] == "manual"
    assert first["workflow"] == "reports" and first["schedule_id"] == "daily"
    assert first["payload"] == {"topic": "x"} and first["run_id"] == entry["id"]
    assert first["execution_options"] == {
        "run_mode": "use_same_run", "selected_run_folder": "iteration-0",
        "execution_strategy": "start_from_beginning_no_human", "workshop_mode": "run",
        "enabled_group_ids": ["g1", "g2"]}
    assert seen[0]["env"]["KANDEVD_RUN_ID"] == entry["id"]
    assert seen[0]["env"]["KANDEVD_SESSION_ID"] == entry["session_id"]
    assert json.loads(Path(seen[0]["env"]["KANDEVD_INPUT"]).read_text()) == first
    job = daemon.call("scheduler.jobs.get", {"id": "workflow:reports:daily"})
    assert (job["last_status"], job["run_count"], job["running"]) == ("success", 1, False)
    assert job["last_session_id"] == entry["session_id"] and job["last_duration_ms"] >= 0


def test_failing_message_stop_already_running_and_default_message(setup) -> None:
    daemon, record = setup({"w": [
        schedule("fails", messages=["ok", "FAIL here", "never"]),
        schedule("sleeps", messages=["SLEEP long", "never"]),
        schedule("plain", workshop_mode="workshop"),
    ]})
    daemon.call("scheduler.jobs.trigger", {"id": "fails"})
    [failed] = terminal(daemon, "fails")
    assert failed["status"] == "error" and failed["error"].startswith("message turn 2 failed")
    assert [t["status"] for t in failed["turns"]] == ["success", "error"]

    daemon.call("scheduler.jobs.trigger", {"id": "sleeps"})
    with pytest.raises(RpcCallError) as busy:
        daemon.call("scheduler.jobs.trigger", {"id": "sleeps"})
    assert busy.value.error["data"]["kind"] == "already_running"
    daemon.wait_until(lambda: started_turns(daemon, "sleeps"), what="the sleeping turn")
    assert daemon.call("scheduler.jobs.get", {"id": "sleeps"})["running"] is True
    daemon.call("scheduler.jobs.stop", {"id": "sleeps"})
    [stopped] = terminal(daemon, "sleeps")
    assert stopped["status"] == "stopped" and len(stopped["turns"]) == 1
    with pytest.raises(RpcCallError) as idle:
        daemon.call("scheduler.jobs.stop", {"id": "sleeps"})
    assert idle.value.error["data"]["kind"] == "not_running"

    daemon.call("scheduler.jobs.trigger", {"id": "plain"})
    [plain] = terminal(daemon, "plain")
    assert [t["message"] for t in plain["turns"]] == [
        "Run the full workflow using run_full_workflow tool."]
    assert not any("never" in r["stdin"]["message"] for r in records(record))


def test_preflight_pulse_and_no_report_when_a_message_reports(setup) -> None:
    daemon, record = setup({"w": [schedule("p", messages=["call run_full_report"],
                                           pulse=True)]}, start=False)
    folder = daemon.home / "workspace" / "Workflow" / "w"
    (folder / "decisions.json").write_text(json.dumps([
        {"id": "d1", "question": "Q?", "answer": "yes", "status": "answered"}]))
    daemon.start()
    daemon.call("scheduler.jobs.trigger", {"id": "p"})
    [entry] = terminal(daemon, "p")
    assert [t["kind"] for t in entry["turns"]] == ["preflight", "message", "pulse"]
    seen = records(record)
    assert seen[0]["stdin"]["workshop_mode"] == "workshop"
    assert seen[0]["stdin"]["decisions"][0]["id"] == "d1"
    assert entry["id"] in seen[2]["stdin"]["message"] and "success" in seen[2]["stdin"]["message"]
    [decision] = json.loads((folder / "decisions.json").read_text())
    assert decision["status"] == "applied"
    assert decision["applied_session_id"] == entry["session_id"]


def test_broken_files_are_reported_and_left_alone(setup) -> None:
    daemon, _ = setup({"good": [schedule("a")], "badtz": [schedule("b", timezone="Mars/X")]},
                      start=False)
    broken = daemon.home / "workspace" / "Workflow" / "broken"
    broken.mkdir(parents=True)
    (broken / "workflow.json").write_text('{"schedules": [')
    good = daemon.home / "workspace" / "Workflow" / "good"
    (good / "schedule-runs.json").write_text("[not json")
    daemon.start()
    daemon.wait_for_line("broken/workflow.json")
    jobs = daemon.call("scheduler.jobs.list")
    assert [j["id"] for j in jobs["items"]] == ["workflow:good:a"]
    errors = daemon.call("daemon.status")["scheduler"]["errors"]
    assert {Path(e["path"]).parent.name for e in errors
            if e["path"].endswith("workflow.json")} == {"broken", "badtz"}
    [corrupt] = [e for e in errors if e["path"].endswith("schedule-runs.json")]
    assert "moved aside to" in corrupt["message"]
    assert not corrupt["message"].startswith(corrupt["path"])  # (named once, by "path")
    # Its job's runs say where they went, not just "0 runs".
    answer = daemon.call("scheduler.jobs.runs", {"id": "workflow:good:a"})
    assert answer["total"] == 0 and "moved aside to" in answer["history_problem"]
    shown = run_cli(daemon.home, "jobs", "runs", "workflow:good:a")
    assert "0 of 0 run(s)\nhistory: not valid JSON" in shown.stdout
    assert any("timezone: unknown time zone 'Mars/X'" in e["message"] for e in errors)
    assert (broken / "workflow.json").read_text() == '{"schedules": ['
    with pytest.raises(RpcCallError) as refused:
        daemon.call("scheduler.jobs.create", {"workflow": "broken",
                                              "schedule": schedule("n")})
    assert refused.value.error["data"]["kind"] == "conflict"
    assert (broken / "workflow.json").read_text() == '{"schedules": ['
    daemon.call("scheduler.jobs.trigger", {"id": "a"})
    [entry] = terminal(daemon, "a")
    assert entry["status"] == "success"
    [aside] = [p for p in good.iterdir() if ".corrupt-" in p.name]
    assert aside.read_text() == "[not json"


def test_restart_fixes_stale_entries_prunes_old_ones_and_remembers_the_last_run(setup) -> None:
    daemon, _ = setup({"w": [schedule("s", "0 0 1 1 *")]}, start=False)
    folder = daemon.home / "workspace" / "Workflow" / "w"
    now = utc_now()
    (folder / "schedule-runs.json").write_text(json.dumps([
        {"id": "stale", "schedule_id": "s", "status": "running", "session_id": "old-session",
         "started_at": rfc3339(now - timedelta(days=800))},
        {"id": "ancient", "schedule_id": "s", "status": "success",
         "started_at": rfc3339(now - timedelta(days=900)),
         "completed_at": rfc3339(now - timedelta(days=900))},
    ]))
    daemon.start()
    job = daemon.call("scheduler.jobs.get", {"id": "s"})
    assert job["last_status"] == "error" and job["last_error"] == "interrupted: server restarted"
    assert job["last_session_id"] == "old-session"
    # every 1 January midnight since the stale run started: two or three of them
    assert job["missed_while_down"] == sum(1 for t in next_fire_times(
        parse_cron("0 0 1 1 *"), now - timedelta(days=800), 10) if t <= now)
    assert job["missed_while_down"] in (2, 3)
    daemon.wait_for_line("missed while the daemon was down")
    entries = history(folder)
    assert entries[0]["status"] == "error" and entries[0]["completed_at"]
    run_id = daemon.call("scheduler.jobs.trigger", {"id": "s"})["run_id"]

    def recorded() -> list[dict[str, Any]] | None:
        items = daemon.call("scheduler.jobs.runs", {"id": "s"})["items"]
        return items if items[0]["id"] == run_id and items[0]["status"] != "running" \
            else None
    finished = daemon.wait_until(recorded, what="the triggered run recorded")
    assert [e["id"] for e in finished][1:] == ["stale"]  # "ancient" pruned (90 days)
    assert daemon.stop() == 0
    daemon.start()
    again = daemon.call("scheduler.jobs.get", {"id": "s"})
    assert again["last_session_id"] == finished[0]["session_id"]
    assert again["last_status"] == "success" and again["run_count"] == 2


def test_sighup_reloads_added_changed_and_removed_schedules(setup) -> None:
    daemon, _ = setup({"w": [schedule("a"), schedule("b")]})
    root = daemon.home / "workspace"
    write_workflow(root, "w", [schedule("a", "30 6 * * *")], groups=("g1",))
    write_workflow(root, "new", [schedule("c")], groups=("g1",))
    mark = daemon.mark()
    daemon.send_signal(signal.SIGHUP)
    daemon.wait_for_line("scheduler reloaded", after=mark)
    jobs = {j["id"]: j for j in daemon.call("scheduler.jobs.list")["items"]}
    assert sorted(jobs) == ["workflow:new:c", "workflow:w:a"]
    assert jobs["workflow:w:a"]["cron_expression"] == "30 6 * * *"
    assert daemon.call("daemon.status")["state"] == "running"
    assert daemon.stop() == 0


def test_sigint_records_the_session_in_flight_stopped_before_the_last_line(setup) -> None:
    daemon, record = setup({"w": [schedule("s", messages=["SLEEP", "never"])]},
                           stop_grace_s=0.2)
    daemon.call("scheduler.jobs.trigger", {"id": "s"})
    daemon.wait_until(lambda: started_turns(daemon, "s"), what="the first turn")
    assert daemon.stop(signal.SIGINT) == 0
    lines = daemon.lines
    assert lines[-1].endswith("Graceful shutdown complete")
    [entry] = history(daemon.home / "workspace" / "Workflow" / "w")
    assert entry["status"] == "stopped"
    assert entry["error"] == "interrupted: server shutting down"
    assert len(entry["turns"]) == 1
    assert not any("never" in r["stdin"]["message"] for r in records(record))
    assert "database is closed" not in daemon.log_text


def test_a_cron_fire_on_the_minute_and_every_switch_that_skips_it(setup, tmp_path: Path,
                                                                  daemon_factory) -> None:
    """One wait for the next minute serves five daemons: one runs the fire, four skip it."""
    every_minute = [schedule("m", "* * * * *")]
    runner, record = setup({"w": every_minute})
    variants = {
        "paused": {},
        "env-off": {"SCHEDULER_ENABLED": "false"},
        "blocked": {"SCHEDULER_BLOCKED_WORKFLOWS": "W"},
        "not-allowed": {"SCHEDULER_ALLOWED_WORKFLOWS": "other, ,"},
    }
    skipped: dict[str, DaemonProcess] = {}
    for name, env in variants.items():
        home = tmp_path / name
        write_workflow(home / "workspace", "w", every_minute)
        if name == "paused":  # paused on disk before the start: no race with the minute
            (home / "workspace" / "config").mkdir()
            (home / "workspace" / "config" / "scheduler.json").write_text(json.dumps(
                {"globally_paused": True, "paused_by": "ops"}))
        daemon = daemon_factory(recorder_config(tmp_path / f"{name}.jsonl"), home=home,
                                env=env)
        job = daemon.call("scheduler.jobs.get", {"id": "m"})
        assert job["cron_eligible"] is False and job["cron_ineligible_reason"], name
        skipped[name] = daemon
    config = skipped["env-off"].call("scheduler.config.get")
    assert config["execution_enabled"] is False and config["disabled_via_env"] is True
    assert config["disabled_reason"] == "SCHEDULER_ENABLED=false in the environment"
    assert skipped["not-allowed"].call("scheduler.config.get")["allowed_workflows"] == ["other"]
    assert skipped["paused"].call("scheduler.config.get")["paused_by"] == "ops"

    # The daemons started one after another, and a minute may have turned in between:
    # the first boundary after the last start is one that every daemon saw coming.
    boundary = (datetime.now(UTC) + timedelta(minutes=1)).replace(second=0, microsecond=0)
    wait_s = (boundary - datetime.now(UTC)).total_seconds() + 30

    def fired_at_boundary() -> dict[str, Any] | None:
        for entry in runner.call("scheduler.jobs.runs", {"id": "m"})["items"]:
            started = datetime.fromisoformat(entry["started_at"].replace("Z", "+00:00"))
            if started >= boundary and entry["status"] != "running":
                return entry
        return None

    entry = runner.wait_until(fired_at_boundary, what="the fire at the boundary",
                              timeout=wait_s + 30)
    assert entry["trigger_source"] == "cron"
    started = datetime.fromisoformat(entry["started_at"].replace("Z", "+00:00"))
    assert started.second == 0  # on the minute
    assert all(r["stdin"]["triggered_by"] == "cron" for r in records(record))
    for name, daemon in skipped.items():
        counter = "skipped_paused" if name == "paused" else "skipped_disabled"
        daemon.wait_for_line("cron fire skipped", timeout=wait_s)
        job = daemon.call("scheduler.jobs.get", {"id": "m"})
        assert job[counter] >= 1 and job["run_count"] == 0, name
        daemon.call("scheduler.jobs.trigger", {"id": "m"})  # manual always works
        [manual] = terminal(daemon, "m")
        assert manual["trigger_source"] == "manual" and manual["status"] == "success", name


def test_bad_requests_get_precise_errors_and_an_unreadable_root_is_reported(setup) -> None:
    daemon, _ = setup({}, start=False)
    (daemon.home / "workspace").mkdir(parents=True)
    (daemon.home / "workspace" / "Workflow").write_text("a file, not a folder")
    daemon.start()
    [error] = daemon.call("daemon.status")["scheduler"]["errors"]
    assert error["message"].startswith("cannot read")
    for params, fragment in [
        ({"schedule": {"cron_expression": "* * * * *"}, "after": "9999-12-31T23:59:59Z"},
         "out of range"),
        ({"schedule": {"cron_expression": "* * * * *"}, "after": "2026-01-01 00:00"},
         "not an RFC 3339 timestamp"),
        ({"schedule": {"cron_expression": "* * * *"}}, "not a valid 5-field cron"),
        ({"schedule": {"cron_expression": "* * * * *", "timezone": "Mars/X"}},
         "unknown time zone"),
    ]:
        with pytest.raises(RpcCallError) as info:
            daemon.call("scheduler.jobs.next", params)
        assert info.value.error["code"] == -32602 and fragment in info.value.error["message"]
    with pytest.raises(RpcCallError) as info:
        daemon.call("scheduler.jobs.create", {"workflow": "../x", "schedule": schedule("s")})
    assert info.value.error["code"] == -32602
    mark = daemon.mark()
    daemon.send_signal(signal.SIGHUP)
    daemon.wait_for_line("scheduler reloaded", after=mark)
    assert "Traceback" not in daemon.log_text
    assert daemon.stop() == 0


def test_a_session_whose_schedule_was_removed_is_still_stopped_by_its_id(setup) -> None:
    """A schedule removed while its session runs: the session ends under the definition it
    started with, and `jobs stop` with the job's full id still reaches it."""
    daemon, _ = setup({"w": [schedule("s", messages=["SLEEP", "never"]), schedule("t")]})
    daemon.call("scheduler.jobs.trigger", {"id": "s"})
    daemon.wait_until(lambda: started_turns(daemon, "s"), what="the first turn")
    write_workflow(daemon.home / "workspace", "w", [schedule("t")], groups=("g1", "g2"))
    daemon.call("scheduler.reload")
    with pytest.raises(RpcCallError) as gone:
        daemon.call("scheduler.jobs.get", {"id": "workflow:w:s"})
    assert gone.value.kind == "not_found"
    answer = daemon.call("scheduler.jobs.stop", {"id": "workflow:w:s"})
    assert answer["stopping"] is True and answer["session_id"]
    folder = daemon.home / "workspace" / "Workflow" / "w"
    [entry] = daemon.wait_until(
        lambda: [e for e in history(folder) if e["status"] != "running"] or None,
        what="the session stopped")
    assert entry["status"] == "stopped" and entry["schedule_id"] == "s"
