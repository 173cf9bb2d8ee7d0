"""A daemon killed alone (``kill -9`` of its pid, not its agents) restarts without
executing a run twice at once. With ``runtime.adopt_on_restart: false`` it stops
the agents its predecessor left, then re-queues their runs (adoption, the
default, is covered in test_failure_model.py).

The echo agent appends a ``touch`` line only when an execution completes, so
the file tells how many executions of the run ran to their end.
"""

from __future__ import annotations

import os
import select
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.daemon import FAST_CONFIG, DaemonProcess

pytestmark = pytest.mark.integration

Factory = Callable[..., DaemonProcess]
STOPPED_LINE = "stopped 1 agent process(es) left by a previous instance"
REQUEUED_LINE = "re-queued 1 run(s) claimed by a previous daemon instance"


def _state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2:].split()[0]


def _agent_asleep(pid: int) -> bool:
    """True once the agent (the keeper's child, leading its own session) sleeps.

    Not merely exec'd: the echo agent catches SIGTERM and is inside its sleep
    (``clock_nanosleep``, system call 230 on x86-64, 115 on arm64), so the
    freeze below always catches it where the test means, however long its
    start-up takes on a loaded machine.
    """
    try:
        if b"kandevd.agents.echo" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return False
        caught = next((int(line.split()[1], 16) for line in
                       Path(f"/proc/{pid}/status").read_text().splitlines()
                       if line.startswith("SigCgt:")), 0)
        if not caught & (1 << (signal.SIGTERM - 1)):
            return False
        call = Path(f"/proc/{pid}/syscall").read_text().split()
        return bool(call) and call[0] in ("230", "115")
    except OSError:
        return False


def test_restart_stops_the_agents_of_a_killed_daemon_before_requeueing(
        daemon_factory: Factory, tmp_path: Path) -> None:
    touch = tmp_path / "touch.log"
    daemon = daemon_factory({**FAST_CONFIG, "runtime": {**FAST_CONFIG["runtime"],
                                                        "adopt_on_restart": False}})
    daemon.call("workspaces.create", {"id": "w1", "name": "w1"})
    daemon.call("agents.create", {"id": "a1", "workspace_id": "w1", "name": "a1"})
    run = daemon.call("runs.enqueue", {"workspace_id": "w1", "agent_id": "a1",
                                       "reason": "manual", "coalesce": False,
                                       "payload": {"sleep_s": 8, "touch": str(touch)}})["run"]

    [old_agent] = daemon.wait_until(daemon.agent_pids, what="the agent")
    daemon.wait_until(lambda: _agent_asleep(old_agent), what="the agent asleep")
    # Freeze the first execution mid-sleep: whatever the restart takes, it cannot
    # finish on its own, and only the restart can end it (SIGTERM needs a SIGCONT).
    os.killpg(old_agent, signal.SIGSTOP)
    # (a stop signal takes effect when the agent next runs: on a busy machine, a moment)
    daemon.wait_until(lambda: _state(old_agent) == "T", what="the agent stopped")
    pidfd = os.pidfd_open(old_agent)  # readable once that very process has exited
    try:
        assert daemon.kill_daemon_only() == -signal.SIGKILL
        assert daemon.agent_pids() == [old_agent]  # the agent outlived its daemon
        assert _state(old_agent) == "T"
        assert not touch.exists()
        with daemon.db() as conn:
            row = conn.execute("SELECT status FROM runs WHERE id = ?", (run["id"],)).fetchone()
        assert row["status"] == "claimed"

        daemon.start()
        stopped_at = daemon.lines.index(daemon.wait_for_line(STOPPED_LINE))
        # Gone by the time the line is logged, and before its run went back to the queue.
        assert select.select([pidfd], [], [], 0)[0] == [pidfd]
        assert daemon.lines.index(daemon.wait_for_line(REQUEUED_LINE)) > stopped_at
        assert f"stopping agent process {old_agent} (run {run['id']})" in daemon.log_text
    finally:
        os.close(pidfd)

    def finished() -> bool:
        with daemon.db() as conn:
            row = conn.execute("SELECT status FROM runs WHERE id = ?", (run["id"],)).fetchone()
        return row["status"] == "finished"

    daemon.wait_until(finished, what="the re-queued run to finish")
    lines = touch.read_text().splitlines()
    assert len(lines) == 1, lines  # the stopped first execution never completed
    assert lines[0].split()[0] == run["id"]
    assert old_agent not in daemon.agent_pids()
