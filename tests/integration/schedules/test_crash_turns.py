"""A daemon SIGKILLed (or stopped keeping its agents) during a scheduled turn, then started
again (the real daemon, a real subprocess agent): the live turn is adopted (the job runs
until it ends, ``jobs stop`` reaches it) and its run is not stale: the entry stays
``running`` meanwhile and ends with the turn's real outcome, ``success`` included, which
the job's ``last_status``, failure streak, metrics, notification and
``pause_after_failures`` follow; a turn that ended while no daemon ran ends its run the
same way. Only a run whose turn left no recorded end is ``error: interrupted: server
restarted``. The turn's output is recorded, its stdout merged into its log and nothing
left behind; no second agent runs meanwhile."""

from __future__ import annotations

import json
import os
import re
import select
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kandevd.control.client import RpcCallError
from tests.support.daemon import DaemonProcess, run_cli
from tests.support.workflows import recorder_config, records, schedule, write_workflow

pytestmark = pytest.mark.integration

JOB = "workflow:w:s"


def holding(tmp_path: Path, daemon_factory: Callable[..., DaemonProcess], *,
            options: dict[str, Any] | None = None, **runtime: Any
            ) -> tuple[DaemonProcess, Path, int]:
    """A daemon whose session's first turn holds; the turn's shim pid."""
    home = tmp_path / "home"
    write_workflow(home / "workspace", "w",
                   [schedule("s", messages=["HOLD", "next"], **(options or {}))])
    record = tmp_path / "record.jsonl"
    daemon = daemon_factory(recorder_config(record, **runtime), home=home)
    daemon.call("scheduler.jobs.trigger", {"id": JOB})
    held = Path(str(record) + ".held")
    daemon.wait_until(held.exists, what="the turn's agent holding")
    [shim] = daemon.agent_pids()
    return daemon, record, shim


@pytest.fixture
def crashed(tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]
            ) -> tuple[DaemonProcess, Path, int]:
    """A daemon killed while the first turn of a session holds; the shim's pid."""
    daemon, record, shim = holding(tmp_path, daemon_factory)
    daemon.kill_daemon_only()
    return daemon, record, shim


def leftovers(daemon: DaemonProcess) -> list[str]:
    """Files a turn's execution left: its record folder, or (older versions) files
    beside its log."""
    sessions = daemon.home / "logs" / "sessions"
    beside = [p.name for p in sessions.rglob("*") if ".stdout-" in p.name
              or ".exit-" in p.name]
    turns = daemon.home / "turns"
    return sorted(beside + ([p.name for p in turns.iterdir()] if turns.exists() else []))


def adopted_and_released(daemon: DaemonProcess, record: Path) -> dict[str, Any]:
    """Wait for the adoption, check the job and its run are running meanwhile (not a
    failure), release the agent; the entry once the run's end is recorded."""
    daemon.wait_for_line("adopted turn")
    job = daemon.call("scheduler.jobs.get", {"id": JOB})
    assert job["running"] is True and job["state"] == "running"
    assert job["consecutive_failures"] == 0 and job["last_status"] != "error", job
    with pytest.raises(RpcCallError) as busy:  # no second session while the turn runs
        daemon.call("scheduler.jobs.trigger", {"id": JOB})
    assert busy.value.kind == "already_running"
    running = newest(daemon)
    assert (running["status"], running["error"], running["completed_at"]) == (
        "running", None, None)
    assert running["turns"][0]["status"] == "running"
    Path(str(record) + ".release").touch()
    return ended(daemon)


def ended(daemon: DaemonProcess) -> dict[str, Any]:
    """The newest entry once it (and the job's session) has ended."""
    return daemon.wait_until(
        lambda: (e := newest(daemon))["status"] != "running"
        and not daemon.call("scheduler.jobs.get", {"id": JOB})["running"] and e,
        what="the run's end recorded")


def a_success_everywhere(daemon: DaemonProcess, entry: dict[str, Any]) -> None:
    """The run ended ``success`` and every view of the job says so (not a failure)."""
    assert (entry["status"], entry["error"]) == ("success", None), entry
    job = daemon.call("scheduler.jobs.get", {"id": JOB})
    assert (job["last_status"], job["last_error"], job["consecutive_failures"],
            job["run_count"]) == ("success", None, 0, 1), job
    assert job["last_session_id"] == entry["session_id"]
    [listed] = daemon.call("scheduler.jobs.list")["items"]
    assert (listed["last_status"], listed["consecutive_failures"]) == ("success", 0)
    metrics = daemon.call("daemon.metrics")
    assert f'kandevd_cron_job_consecutive_failures{{job="{JOB}"}} 0.0' in metrics
    assert f'kandevd_cron_job_last_success_timestamp_seconds{{job="{JOB}"}}' in metrics
    shown = run_cli(daemon.home, "jobs", "get", JOB).stdout
    assert re.search(r"^last_status\s+success$", shown, re.M), shown
    assert re.search(r"^consecutive_failures\s+0$", shown, re.M), shown


def newest(daemon: DaemonProcess) -> dict[str, Any]:
    entry: dict[str, Any] = daemon.call("scheduler.jobs.runs", {"id": JOB})["items"][0]
    return entry


def test_a_turn_that_ended_while_no_daemon_ran_is_recorded_at_start(crashed) -> None:
    daemon, record, shim = crashed
    pidfd = os.pidfd_open(shim)
    try:
        Path(str(record) + ".release").touch()  # the agent ends while no daemon runs
        assert select.select([pidfd], [], [], 30)[0] == [pidfd]
    finally:
        os.close(pidfd)
    assert leftovers(daemon)  # its record, exit status and stdout wait for the next start
    daemon.start()
    daemon.wait_for_line("settled 1 scheduled turn(s)")
    entry = newest(daemon)
    [turn] = entry["turns"]
    assert (turn["status"], turn["exit_code"], turn["output"]) == ("success", 0, "did HOLD")
    assert turn["cost_cents"] == 3 and entry["cost_cents"] == 3
    a_success_everywhere(daemon, entry)  # its turn's end was found: not stale
    assert '"summary": "did HOLD"' in Path(turn["log_path"]).read_text()
    assert leftovers(daemon) == []
    assert [r["stdin"]["message"] for r in records(record)] == ["HOLD"]  # "next" never sent


def test_a_turn_that_left_no_end_leaves_its_run_interrupted(
        tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon, _record, _shim = holding(tmp_path, daemon_factory)
    daemon.kill9()  # the agent and its shim too: no exit status is ever written
    daemon.start()
    daemon.wait_for_line("settled 1 scheduled turn(s)")
    entry = newest(daemon)
    assert (entry["status"], entry["error"]) == ("error", "interrupted: server restarted")
    assert entry["turns"][0]["status"] == "error"
    job = daemon.call("scheduler.jobs.get", {"id": JOB})
    assert (job["last_status"], job["consecutive_failures"]) == ("error", 1)


def test_a_turn_still_running_at_start_is_adopted_and_its_end_recorded(crashed) -> None:
    daemon, record, _shim = crashed
    daemon.start()
    entry = adopted_and_released(daemon, record)
    [turn] = entry["turns"]
    assert (turn["status"], turn["exit_code"], turn["output"]) == ("success", 0, "did HOLD")
    assert turn["cost_cents"] == 3 and entry["cost_cents"] == 3
    a_success_everywhere(daemon, entry)
    assert entry["completed_at"] >= turn["started_at"] and entry["duration_ms"] > 0
    daemon.wait_for_line(f"session {entry['session_id']} of {JOB} ended: success")
    assert '"summary": "did HOLD"' in Path(turn["log_path"]).read_text()
    [seen] = records(record)  # one agent, never terminated, "next" never sent
    assert seen["terminated"] is False
    daemon.wait_until(lambda: leftovers(daemon) == [], what="the turn's record removed")
    daemon.wait_until(lambda: not daemon.call("scheduler.jobs.get", {"id": JOB})["running"],
                      what="the job free again")
    daemon.call("scheduler.jobs.trigger", {"id": JOB})  # and it runs again
    # (its second turn may follow at once: two records more, seen together)
    daemon.wait_until(lambda: len(records(record)) >= 2, what="a new session's first turn")


def test_a_turn_adopted_then_left_again_is_adopted_by_the_next_start(crashed) -> None:
    daemon, record, shim = crashed
    daemon.start()
    daemon.wait_for_line("adopted turn")
    daemon.kill_daemon_only()  # the adopter dies in turn
    assert daemon.agent_pids() == [shim]
    daemon.start()
    entry = adopted_and_released(daemon, record)
    assert [(t["status"], t["output"]) for t in entry["turns"]] == [("success", "did HOLD")]
    a_success_everywhere(daemon, entry)
    [seen] = records(record)
    assert seen["terminated"] is False
    daemon.wait_until(lambda: leftovers(daemon) == [], what="the turn's record removed")


def test_an_adopted_turn_that_fails_is_a_failure_told_and_counted(
        tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]) -> None:
    told = tmp_path / "told.jsonl"
    command = [sys.executable, "-c", "import sys\n"
               f"open({str(told)!r}, 'a').write(sys.stdin.read() + '\\n')"]
    home = tmp_path / "home"
    write_workflow(home / "workspace", "w", [schedule(
        "s", messages=["HOLD FAIL"], workshop_mode="workshop", pause_after_failures=1,
        notify={"command": command, "on": ["failure", "recovery", "success"]})])
    record = tmp_path / "record.jsonl"
    daemon = daemon_factory(recorder_config(record), home=home)
    daemon.call("scheduler.jobs.trigger", {"id": JOB})
    daemon.wait_until(Path(str(record) + ".held").exists, what="the turn's agent holding")
    daemon.kill_daemon_only()
    daemon.start()
    entry = adopted_and_released(daemon, record)
    assert (entry["status"], entry["error"]) == ("error", "message turn 1 failed: exit code 1")
    job = daemon.wait_until(lambda: (j := daemon.call("scheduler.jobs.get", {"id": JOB}))[
        "state"] == "disabled" and j, what="paused after the failure")
    assert (job["last_status"], job["consecutive_failures"]) == ("error", 1)
    assert job["state_reason"].startswith("paused after 1 consecutive failures")
    bodies = daemon.wait_until(lambda: told.exists() and [
        json.loads(line) for line in told.read_text().splitlines()], what="the notification")
    assert [(b["event"], b["id"]) for b in bodies] == [("paused", entry["id"])]


def test_jobs_stop_reaches_an_adopted_turn(crashed) -> None:
    daemon, record, _shim = crashed
    daemon.start()
    daemon.wait_for_line("adopted turn")
    daemon.call("scheduler.jobs.stop", {"id": JOB})
    entry = daemon.wait_until(
        lambda: (e := newest(daemon))["turns"][0]["status"] != "running" and e,
        what="the stopped turn recorded")
    [turn] = entry["turns"]
    assert (turn["status"], turn["error"]) == ("stopped",
                                               "stopped: stopped by scheduler.jobs.stop")
    entry = ended(daemon)
    assert (entry["status"], entry["error"]) == ("stopped", "stopped: scheduler.jobs.stop")
    [seen] = records(record)
    assert seen["terminated"] is True
    daemon.wait_until(lambda: leftovers(daemon) == [], what="the turn's record removed")


def test_the_jobs_timeout_still_applies_to_an_adopted_turn(
        tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon, record, _shim = holding(tmp_path, daemon_factory, options={"timeout_s": 8})
    daemon.kill_daemon_only()
    daemon.start()
    daemon.wait_for_line("adopted turn")
    entry = daemon.wait_until(
        lambda: (e := newest(daemon))["turns"][0]["status"] != "running" and e,
        what="the timed-out turn recorded")
    [turn] = entry["turns"]
    assert (turn["status"], turn["error"]) == ("error", "timed out after 8s")
    entry = ended(daemon)
    assert (entry["status"], entry["error"]) == ("error", "timed out after 8s")
    [seen] = records(record)
    assert seen["terminated"] is True


def test_a_graceful_stop_keeping_agents_leaves_the_turn_to_the_next_start(
        tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon, record, shim = holding(tmp_path, daemon_factory, keep_agents_on_stop=True)
    assert daemon.stop() == 0
    assert daemon.agent_pids() == [shim]  # still working
    history = json.loads((daemon.home / "workspace" / "Workflow" / "w" /
                          "schedule-runs.json").read_text())
    assert history[0]["status"] == "running"  # not over: the next start says how it ended
    daemon.start()
    entry = adopted_and_released(daemon, record)
    assert [(t["status"], t["output"]) for t in entry["turns"]] == [("success", "did HOLD")]
    a_success_everywhere(daemon, entry)
    daemon.wait_until(lambda: leftovers(daemon) == [], what="the turn's record removed")


def test_with_adoption_off_a_live_turn_is_stopped_first_then_recorded(
        tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon, record, _shim = holding(tmp_path, daemon_factory, adopt_on_restart=False)
    daemon.kill_daemon_only()
    daemon.start()  # the agent still holds: stopped before anything can start
    daemon.wait_for_line("settled 1 scheduled turn(s)")
    [seen] = records(record)
    assert seen["terminated"] is True  # one agent only, ended by the start, not twice
    entry = newest(daemon)
    [turn] = entry["turns"]
    assert turn["status"] == "error" and turn["output"] == "did HOLD"
    assert turn["error"].endswith("(the daemon had restarted)")
    assert (entry["status"], entry["error"]) == ("error",
                                                 f"message turn 1 failed: {turn['error']}")
    assert leftovers(daemon) == []
    Path(str(record) + ".release").touch()
    daemon.call("scheduler.jobs.trigger", {"id": JOB})  # the job runs again at once
    # (its second turn may follow at once: two records more, seen together)
    daemon.wait_until(lambda: len(records(record)) >= 2, what="a new session's first turn")
