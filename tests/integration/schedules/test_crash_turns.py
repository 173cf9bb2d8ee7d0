"""A daemon SIGKILLed during a scheduled turn, then started again (the real daemon, a real
subprocess agent): the entry ends ``error: interrupted: server restarted`` as the
specification says, with the turn's real outcome and output recorded, its stdout merged
into its log and nothing left beside the logs; no second agent runs meanwhile."""

from __future__ import annotations

import os
import select
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.daemon import DaemonProcess
from tests.support.workflows import recorder_config, records, schedule, write_workflow

pytestmark = pytest.mark.integration

JOB = "workflow:w:s"


@pytest.fixture
def crashed(tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]
            ) -> tuple[DaemonProcess, Path, int]:
    """A daemon killed while the first turn of a session holds; the shim's pid."""
    home = tmp_path / "home"
    write_workflow(home / "workspace", "w", [schedule("s", messages=["HOLD", "next"])])
    record = tmp_path / "record.jsonl"
    daemon = daemon_factory(recorder_config(record), home=home)
    daemon.call("scheduler.jobs.trigger", {"id": JOB})
    held = Path(str(record) + ".held")
    daemon.wait_until(held.exists, what="the turn's agent holding")
    [shim] = daemon.agent_pids()
    daemon.kill_daemon_only()
    return daemon, record, shim


def leftovers(daemon: DaemonProcess) -> list[str]:
    sessions = daemon.home / "logs" / "sessions"
    return sorted(p.name for p in sessions.rglob("*") if ".stdout-" in p.name
                  or ".exit-" in p.name)


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
    assert leftovers(daemon)  # its exit status and stdout wait beside its log
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


def test_a_turn_still_running_at_start_is_stopped_first_then_recorded(crashed) -> None:
    daemon, record, _shim = crashed
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
