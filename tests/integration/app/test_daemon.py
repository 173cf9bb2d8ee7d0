"""The daemon process: graceful stops, the forced exit, single instance, restart, bad config.

Every test runs a real ``kandevd serve`` subprocess on a temp home and talks to
it through its real socket and real signals (tests/harness.py).
"""

from __future__ import annotations

import ctypes
import os
import signal
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.daemon import (
    COMPLETE,
    FAST_CONFIG,
    FORCED,
    STARTED,
    DaemonProcess,
    assert_graceful,
    blocked_stop_daemon,
)

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_idle_signal_stops_gracefully(daemon_factory: Callable[..., DaemonProcess],
                                      sig: signal.Signals) -> None:
    daemon = daemon_factory()
    assert daemon.call("daemon.status")["state"] == "running"
    assert_graceful(daemon, daemon.stop(sig))
    assert daemon.count_lines(f"received {sig.name}") == 1


def test_daemon_shutdown_over_the_socket_stops_gracefully(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon = daemon_factory()
    assert daemon.call("daemon.shutdown") == {}
    assert_graceful(daemon, daemon.wait())


def test_status_reports_the_process_and_its_loops(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon = daemon_factory()
    status = daemon.call("daemon.status")
    assert status["pid"] == daemon.proc.pid
    assert status["home"] == str(daemon.home.resolve())
    assert status["started_at"].endswith("Z")
    assert set(status["loops"]) >= {"queue", "office", "cron"}
    assert set(status["loops"].values()) <= {"stopped", "running", "stopping"}
    assert status["loops"]["queue"] == "running"
    keeper = status["runtime"].pop("keeper")
    assert status["runtime"] == {"active": 0, "max_concurrent": FAST_CONFIG["runtime"]
                                 ["max_concurrent"]}
    assert keeper["pid"] in daemon.keeper_pids() and keeper["agents"] == 0
    assert keeper["restarts"] == 0 and keeper["started_at"].endswith("Z")
    assert_graceful(daemon, daemon.stop())


def test_home_is_0700_and_a_second_daemon_on_it_exits_75_naming_the_pid(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    first = daemon_factory()
    for folder in (first.home, first.home / "logs"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert (first.home / "kandevd.lock").read_text().strip() == str(first.proc.pid)

    second = daemon_factory(home=first.home, start=False)
    second.start(wait_ready=False)
    assert second.wait() == 75
    assert f"pid {first.proc.pid}" in second.log_text
    assert (first.home / "kandevd.lock").read_text().strip() == str(first.proc.pid)
    assert first.call("daemon.status")["pid"] == first.proc.pid  # the first one is untouched
    assert_graceful(first, first.stop())


def test_restart_after_kill_9_reuses_the_home(daemon_factory: Callable[..., DaemonProcess]
                                              ) -> None:
    daemon = daemon_factory()
    daemon.call("workspaces.create", {"id": "kept", "name": "survives a kill -9"})
    first_pid = daemon.proc.pid
    daemon.kill9()
    assert daemon.socket.exists()  # a stale socket file is left behind

    daemon.start()  # same home, same lock file, same database
    assert daemon.count_lines("replacing stale control socket") == 1
    assert daemon.call("daemon.status")["pid"] not in (first_pid, None)
    assert daemon.call("workspaces.get", {"id": "kept"})["name"] == "survives a kill -9"
    with daemon.db() as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert_graceful(daemon, daemon.stop())


def test_a_second_signal_during_a_blocked_stop_forces_exit_1(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon, run_id = blocked_stop_daemon(daemon_factory)
    daemon.send_signal(signal.SIGINT)
    daemon.wait_for_line(STARTED)
    assert daemon.proc.poll() is None  # still inside its graceful stop
    daemon.send_signal(signal.SIGINT)
    assert daemon.wait(timeout=30) == 1
    assert daemon.count_lines(FORCED) == 1
    assert daemon.count_lines(COMPLETE) == 0
    with daemon.db() as conn:  # the interrupted run is left claimed for the next start
        row = conn.execute("SELECT status FROM runs WHERE id = ?", (run_id,)).fetchone()
    assert row["status"] == "claimed"


def _tgkill(pid: int, tid: int, sig: int) -> None:
    """Send ``sig`` to one thread of another process (what the kernel may do by itself)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.tgkill(pid, tid, sig) != 0:
        raise OSError(ctypes.get_errno(), "tgkill failed")


def _thread_state(pid: int, tid: int) -> str:
    """The scheduler state letter of one thread (R running, S sleeping, ...)."""
    stat_line = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    return stat_line.rsplit(")", 1)[1].split()[0]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_a_second_signal_delivered_to_another_thread_still_forces_exit(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """The main thread must not sit in an untimed join while the stop is blocked."""
    daemon, _run_id = blocked_stop_daemon(daemon_factory)
    daemon.send_signal(signal.SIGINT)
    daemon.wait_for_line(STARTED)
    pid = daemon.proc.pid
    # Wait until the stop is parked in the runtime's grace wait and the main thread sleeps.
    daemon.wait_for_line("runtime stopping")
    daemon.wait_until(lambda: _thread_state(pid, pid) == "S", what="the main thread asleep")
    others = sorted(int(tid) for tid in os.listdir(f"/proc/{pid}/task") if int(tid) != pid)
    assert others, "the stopping daemon has worker threads"
    _tgkill(pid, others[0], signal.SIGINT)
    assert daemon.wait(timeout=20) == 1  # well before the 60 s the stop would take
    assert daemon.count_lines(FORCED) == 1


@pytest.mark.parametrize(("config", "key"), [
    ({"queue": {"safety_interval_s": -1}}, "queue.safety_interval_s"),
    ({"queue": {"no_such_key": 1}}, "queue.no_such_key"),
    ({"runtime": {"max_concurrent": "many"}}, "runtime.max_concurrent"),
])
def test_a_bad_config_exits_78_naming_the_key(daemon_factory: Callable[..., DaemonProcess],
                                              config: dict[str, Any], key: str) -> None:
    daemon = daemon_factory(config, start=False)
    daemon.start(wait_ready=False)
    assert daemon.wait() == 78
    assert key in daemon.log_text
    assert not daemon.socket.exists()
    assert not (daemon.home / "kandevd.db").exists()  # nothing was touched


def test_an_explicit_config_file_is_used(daemon_factory: Callable[..., DaemonProcess],
                                         tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "custom.yaml")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("runtime:\n  max_concurrent: 3\n")
    daemon = daemon_factory(args=["--config", path])
    assert daemon.call("daemon.status")["runtime"]["max_concurrent"] == 3
    assert_graceful(daemon, daemon.stop())


def test_json_log_format_keeps_the_contract_lines(daemon_factory: Callable[..., DaemonProcess]
                                                  ) -> None:
    import json

    daemon = daemon_factory(args=["--log-format", "json"])
    code = daemon.stop(signal.SIGTERM)
    entries = [json.loads(line) for line in daemon.lines if line.strip()]
    assert code == 0
    assert entries[-1]["msg"] == COMPLETE
    assert {"ts", "level", "logger", "msg"} <= set(entries[-1])
    assert any(entry["msg"] == STARTED for entry in entries)
