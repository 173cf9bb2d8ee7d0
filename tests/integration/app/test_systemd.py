"""systemd integration (CONTRACT.md section 1): sd_notify datagrams and SIGHUP.

A fake notify socket (a SOCK_DGRAM socket bound in the test's temp folder)
stands in for systemd; the daemon finds it through NOTIFY_SOCKET.
"""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

TIMEOUT = 30.0


class FakeSystemd:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.messages: list[str] = []

    def receive_until(self, key: str, timeout: float = TIMEOUT) -> list[str]:
        """Collect datagrams until one carries the line ``key``; return all seen so far."""
        deadline = time.monotonic() + timeout
        while not any(key in message.split("\n") for message in self.messages):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {key!r} from the daemon; got {self.messages!r}")
            self.sock.settimeout(remaining)
            self.messages.append(self.sock.recv(65536).decode())
        return self.messages

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def systemd(tmp_path: Path) -> Iterator[FakeSystemd]:
    fake = FakeSystemd(tmp_path / "notify.sock")
    yield fake
    fake.close()


def lines(messages: list[str]) -> list[str]:
    return [line for message in messages for line in message.split("\n")]


def test_ready_status_then_stopping_around_a_start_and_sigterm(daemon_factory, systemd) -> None:
    daemon = daemon_factory(env={"NOTIFY_SOCKET": str(systemd.path)})
    systemd.receive_until("READY=1")
    assert daemon.call("daemon.status")["state"] == "running"
    daemon.send_signal(signal.SIGTERM)
    seen = lines(systemd.receive_until("STOPPING=1"))
    assert daemon.wait() == 0
    ready, stopping = seen.index("READY=1"), seen.index("STOPPING=1")
    status = [i for i, line in enumerate(seen) if line.startswith("STATUS=")]
    assert ready < status[0] < stopping
    assert "agent(s)" in seen[status[0]]
    assert "WATCHDOG=1" not in seen  # no WATCHDOG_USEC, no pings
    assert "Graceful shutdown complete" in daemon.log_text


def test_watchdog_pings_arrive_when_watchdog_usec_is_set(daemon_factory, systemd) -> None:
    daemon = daemon_factory(env={"NOTIFY_SOCKET": str(systemd.path),
                                 "WATCHDOG_USEC": "200000"})
    systemd.receive_until("READY=1")
    before = len(systemd.messages)
    for _ in range(3):  # keeps pinging (every 0.1 s), not just once at the start
        systemd.messages = systemd.messages[:before]
        systemd.receive_until("WATCHDOG=1", timeout=5)
        before = len(systemd.messages)
    assert daemon.stop(signal.SIGTERM) == 0


def test_sighup_keeps_the_daemon_up_and_says_what_it_reloaded(daemon_factory, systemd) -> None:
    daemon = daemon_factory(env={"NOTIFY_SOCKET": str(systemd.path)})
    mark = daemon.mark()
    for _ in range(3):
        daemon.send_signal(signal.SIGHUP)
        daemon.wait_for_line("received SIGHUP: reloading workflow and product files",
                             after=mark)
        mark = daemon.mark()
    assert daemon.call("daemon.status")["state"] == "running"
    assert daemon.proc is not None and daemon.proc.poll() is None
    assert daemon.stop(signal.SIGTERM) == 0
    assert "Traceback" not in daemon.log_text


def test_sighup_applies_the_log_level_and_names_what_needs_a_restart(daemon_factory) -> None:
    import yaml

    from tests.support.daemon import FAST_CONFIG

    daemon = daemon_factory()
    assert daemon.call("daemon.status")["state"] == "running"
    config_file = daemon.home / "kandevd.yaml"
    edited = {**FAST_CONFIG, "log": {"level": "DEBUG"},
              "queue": {**FAST_CONFIG.get("queue", {}), "max_attempts": 2}}
    config_file.write_text(yaml.safe_dump(edited))
    mark = daemon.mark()
    daemon.send_signal(signal.SIGHUP)
    daemon.wait_for_line("SIGHUP: log level is now DEBUG", after=mark)
    line = daemon.wait_for_line("need a restart", after=mark)
    assert "changes to queue need a restart" in line
    # Another store is a restart too, and the new URL's password is not logged.
    config_file.write_text(yaml.safe_dump({**edited, "store": {
        "url": "postgresql://u:s3cret@db/k"}}))
    mark = daemon.mark()
    daemon.send_signal(signal.SIGHUP)
    line = daemon.wait_for_line("need a restart", after=mark)
    assert "store" in line and "s3cret" not in daemon.log_text
    # A broken file is reported and the running config stays.
    config_file.write_text("queue: [not, a, mapping]\n")
    mark = daemon.mark()
    daemon.send_signal(signal.SIGHUP)
    line = daemon.wait_for_line("SIGHUP: config not reloaded", after=mark)
    assert "kandevd.yaml" in line and "queue" in line
    assert daemon.call("daemon.status")["state"] == "running"
    assert daemon.stop(signal.SIGTERM) == 0
    assert "Traceback" not in daemon.log_text


def test_a_log_level_given_on_the_command_line_wins_over_sighup(daemon_factory) -> None:
    import yaml

    from tests.support.daemon import FAST_CONFIG, run_cli

    daemon = daemon_factory(args=["--log-level", "WARNING"], start=False)
    daemon.start(wait_ready=False)  # at WARNING the "listening" line is not logged
    assert run_cli(daemon.home, "wait", "--timeout", "30").returncode == 0
    (daemon.home / "kandevd.yaml").write_text(
        yaml.safe_dump({**FAST_CONFIG, "log": {"level": "DEBUG"}}))
    mark = daemon.mark()
    daemon.send_signal(signal.SIGHUP)
    daemon.wait_for_line("log.level DEBUG ignored: serve --log-level WARNING wins", after=mark)
    assert daemon.stop(signal.SIGTERM) == 0


def test_without_notify_socket_nothing_changes(daemon_factory) -> None:
    daemon = daemon_factory(env={"NOTIFY_SOCKET": ""})
    assert daemon.call("daemon.status")["state"] == "running"
    assert daemon.stop(signal.SIGTERM) == 0
