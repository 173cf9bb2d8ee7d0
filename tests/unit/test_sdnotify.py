"""kandevd.sdnotify: the datagram protocol against a fake notify socket."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kandevd.sdnotify import SystemdNotifier


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify")
    sock.bind(path)
    sock.settimeout(5)
    yield sock, path
    sock.close()


def test_without_notify_socket_everything_is_a_no_op() -> None:
    sd = SystemdNotifier({})
    assert not sd.enabled
    assert sd.ready("x") is False and sd.stopping() is False and sd.watchdog() is False


def test_ready_status_stopping_in_one_datagram_each(listener) -> None:
    sock, path = listener
    sd = SystemdNotifier({"NOTIFY_SOCKET": path})
    assert sd.status("too early") is False  # nothing before READY=1
    assert sd.ready("running 0/4")
    assert sock.recv(4096) == b"READY=1\nSTATUS=running 0/4"
    assert sd.status("two\nlines")
    assert sock.recv(4096) == b"STATUS=two lines"
    assert sd.stopping()
    assert sock.recv(4096) == b"STOPPING=1\nSTATUS=stopping"


def test_abstract_namespace_address() -> None:
    name = f"kandevd-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(5)
    try:
        assert SystemdNotifier({"NOTIFY_SOCKET": "@" + name}).ready()
        assert sock.recv(4096) == b"READY=1"
    finally:
        sock.close()


def test_watchdog_pings_at_most_every_half_period(listener) -> None:
    sock, path = listener
    sd = SystemdNotifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"})
    assert sd.watchdog_interval_s == pytest.approx(0.1)
    assert sd.watchdog(now=10.0)
    assert not sd.watchdog(now=10.05)
    assert sd.watchdog(now=10.2)
    assert sock.recv(4096) == b"WATCHDOG=1" and sock.recv(4096) == b"WATCHDOG=1"


def test_watchdog_for_another_pid_or_unset_is_off(listener) -> None:
    _sock, path = listener
    assert SystemdNotifier({"NOTIFY_SOCKET": path}).watchdog_interval_s is None
    other = SystemdNotifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000", "WATCHDOG_PID": "1"})
    assert other.watchdog_interval_s is None


def test_a_vanished_socket_never_raises(tmp_path: Path) -> None:
    sd = SystemdNotifier({"NOTIFY_SOCKET": str(tmp_path / "gone")})
    assert sd.ready() is False
    assert sd.notify("STATUS=x") is False
