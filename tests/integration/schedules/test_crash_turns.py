"""A daemon SIGKILLed (or stopped keeping its agents) during a scheduled turn, then started
again (the real daemon, a real subprocess agent): the live turn is adopted (the job runs
until it ends, ``jobs stop`` reaches it), and the entry ends ``error: interrupted: server
restarted`` as the specification says, with the turn's real outcome and output recorded,
its stdout merged into its log and nothing left behind; no second agent runs meanwhile."""

from __future__ import annotations

import json
import os
import select
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kandevd.control.client import RpcCallError
from tests.support.daemon import DaemonProcess
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
    """Wait for the adoption, check the job runs meanwhile, release the agent; the
    entry once the turn's end is recorded."""
    daemon.wait_for_line("adopted turn")
    job = daemon.call("scheduler.jobs.get", {"id": JOB})
    assert job["running"] is True and job["state"] == "running"
    with pytest.raises(RpcCallError) as busy:  # no second session while the turn runs
        daemon.call("scheduler.jobs.trigger", {"id": JOB})
    assert busy.value.kind == "already_running"
    assert newest(daemon)["turns"][0]["status"] == "running"
    Path(str(record) + ".release").touch()
    return daemon.wait_until(
        lambda: (e := newest(daemon))["turns"][0]["status"] != "running" and e,
        what="the adopted turn's end recorded")


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
    assert (entry["status"], entry["error"]) == ("error", "interrupted: server restarted")
    [turn] = entry["turns"]
    assert (turn["status"], turn["exit_code"], turn["output"]) == ("success", 0, "did HOLD")
    assert turn["cost_cents"] == 3 and entry["cost_cents"] == 3
    assert '"summary": "did HOLD"' in Path(turn["log_path"]).read_text()
    assert leftovers(daemon) == []
    assert [r["stdin"]["message"] for r in records(record)] == ["HOLD"]  # "next" never sent


def test_a_turn_still_running_at_start_is_adopted_and_its_end_recorded(crashed) -> None:
    daemon, record, _shim = crashed
    daemon.start()
    entry = adopted_and_released(daemon, record)
    assert (entry["status"], entry["error"]) == ("error", "interrupted: server restarted")
    [turn] = entry["turns"]
    assert (turn["status"], turn["exit_code"], turn["output"]) == ("success", 0, "did HOLD")
    assert turn["cost_cents"] == 3 and entry["cost_cents"] == 3
    assert '"summary": "did HOLD"' in Path(turn["log_path"]).read_text()
    [seen] = records(record)  # one agent, never terminated, "next" never sent
    assert seen["terminated"] is False
    daemon.wait_until(lambda: leftovers(daemon) == [], what="the turn's record removed")
    daemon.wait_until(lambda: not daemon.call("scheduler.jobs.get", {"id": JOB})["running"],
                      what="the job free again")
    daemon.call("scheduler.jobs.trigger", {"id": JOB})  # and it runs again
    daemon.wait_until(lambda: len(records(record)) == 2, what="a new session's first turn")


def test_a_turn_adopted_then_left_again_is_adopted_by_the_next_start(crashed) -> None:
    daemon, record, shim = crashed
    daemon.start()
    daemon.wait_for_line("adopted turn")
    daemon.kill_daemon_only()  # the adopter dies in turn
    assert daemon.agent_pids() == [shim]
    daemon.start()
    entry = adopted_and_released(daemon, record)
    assert entry["error"] == "interrupted: server restarted"
    assert [(t["status"], t["output"]) for t in entry["turns"]] == [("success", "did HOLD")]
    [seen] = records(record)
    assert seen["terminated"] is False
    daemon.wait_until(lambda: leftovers(daemon) == [], what="the turn's record removed")


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
    assert entry["error"] == "interrupted: server restarted"
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
    assert (entry["status"], entry["error"]) == ("error", "interrupted: server restarted")
    assert [(t["status"], t["output"]) for t in entry["turns"]] == [("success", "did HOLD")]
    daemon.wait_until(lambda: leftovers(daemon) == [], what="the turn's record removed")


def test_with_adoption_off_a_live_turn_is_stopped_first_then_recorded(
        tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon, record, _shim = holding(tmp_path, daemon_factory, adopt_on_restart=False)
    daemon.kill_daemon_only()
    daemon.start()  # the agent still holds: stopped before anything can start
    daemon.wait_for_line("settled 1 scheduled turn(s)")
    [seen] = records(record)
    assert seen["terminated"] is True  # one agent only, ended by the start, not twice
    [turn] = newest(daemon)["turns"]
    assert turn["status"] == "error" and turn["output"] == "did HOLD"
    assert turn["error"].endswith("(the daemon had restarted)")
    assert leftovers(daemon) == []
    Path(str(record) + ".release").touch()
    daemon.call("scheduler.jobs.trigger", {"id": JOB})  # the job runs again at once
    daemon.wait_until(lambda: len(records(record)) == 2, what="a new session's first turn")
