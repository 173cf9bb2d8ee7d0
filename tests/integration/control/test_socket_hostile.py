"""Clients that try to lock the control socket up, against a real daemon.

Idle connections beyond the cap, a slowloris client, a client that never
reads its responses: none of them may keep ``kandevd status`` or
``daemon.shutdown`` out, and none may make the daemon log a traceback.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kandevd.control.client import Client
from tests.support.daemon import FAST_CONFIG, DaemonProcess, run_cli

pytestmark = pytest.mark.integration

TIMEOUT = 30.0
IDLE_S = 1.0


def config(idle_timeout_s: float) -> dict[str, Any]:
    return {**FAST_CONFIG, "control": {"idle_timeout_s": idle_timeout_s}}


def connect(path: Path, *, timeout: float = TIMEOUT) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect(str(path))
    return sock


def request_line(method: str, request_id: Any = 1, params: Any = None) -> bytes:
    message: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id, "method": method}
    if params is not None:
        message["params"] = params
    return (json.dumps(message) + "\n").encode()


def wait_closed(sock: socket.socket, timeout: float) -> float:
    """Seconds until the daemon closes ``sock`` (reading and discarding what comes)."""
    start = time.monotonic()
    sock.settimeout(timeout)
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            data = b""
        if not data:
            return time.monotonic() - start


def assert_clean(daemon: DaemonProcess) -> None:
    assert "Traceback" not in daemon.log_text


def test_idle_connections_beyond_the_cap_never_lock_status_or_shutdown_out(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon = daemon_factory(config(60))
    idle = [connect(daemon.socket) for _ in range(70)]
    try:
        start = time.monotonic()
        result = run_cli(daemon.home, "status")
        elapsed = time.monotonic() - start
        assert result.returncode == 0, result.stdout + result.stderr
        print(f"kandevd status with 70 idle connections: {elapsed:.2f} s")
        with Client(daemon.socket, timeout=TIMEOUT) as client:
            assert client.call("daemon.status")["state"] == "running"
            assert client.call("daemon.shutdown") == {}
        assert daemon.wait(TIMEOUT) == 0
        # The oldest idle connections were closed to make room: they read EOF.
        assert wait_closed(idle[0], TIMEOUT) < TIMEOUT
    finally:
        for sock in idle:
            sock.close()
    assert_clean(daemon)


def test_idle_and_slowloris_connections_are_closed_after_the_idle_timeout(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon = daemon_factory(config(IDLE_S))
    silent = connect(daemon.socket)
    slow = connect(daemon.socket)
    busy = connect(daemon.socket)
    stop = threading.Event()
    slow_closed_after: list[float] = []

    def slowloris() -> None:  # one byte a second of a line that never ends
        start = time.monotonic()
        try:
            for byte in request_line("daemon.status")[:-1]:
                slow.sendall(bytes([byte]))
                if stop.wait(0.25):
                    return
        except OSError:  # EPIPE / ECONNRESET: the daemon closed us
            slow_closed_after.append(time.monotonic() - start)

    sender = threading.Thread(target=slowloris)
    sender.start()
    try:
        # A client that completes a request more often than the timeout stays open.
        reader = busy.makefile("rb")
        for n in range(8):
            busy.sendall(request_line("daemon.status", n))
            assert json.loads(reader.readline())["id"] == n
            time.sleep(IDLE_S / 3)
        assert wait_closed(silent, TIMEOUT) < IDLE_S + 2
        sender.join(TIMEOUT)
        assert slow_closed_after, "the slowloris client was never closed"
        assert IDLE_S * 0.8 < slow_closed_after[0] < IDLE_S + 3
        busy.sendall(request_line("daemon.status", "still"))
        assert json.loads(reader.readline())["id"] == "still"
        reader.close()
    finally:
        stop.set()
        sender.join(TIMEOUT)
        for sock in (silent, slow, busy):
            sock.close()
    with Client(daemon.socket) as client:
        assert client.call("daemon.status")["state"] == "running"
    assert daemon.stop() == 0
    assert_clean(daemon)


def test_a_client_that_never_reads_is_dropped_and_others_are_served(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon = daemon_factory(config(IDLE_S))
    hog = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    hog.settimeout(TIMEOUT)
    hog.connect(str(daemon.socket))
    batch = request_line("daemon.status") * 200
    outcome: list[str] = []

    def flood() -> None:
        try:
            for _ in range(200):  # 40,000 requests, never a read
                hog.sendall(batch)
            outcome.append("sent everything")
        except OSError as exc:
            outcome.append(f"dropped: {exc!r}")

    mark = daemon.mark()
    sender = threading.Thread(target=flood)
    sender.start()
    try:
        start = time.monotonic()
        while sender.is_alive() and time.monotonic() - start < IDLE_S:  # while it is stuck
            with Client(daemon.socket, timeout=5) as other:
                assert other.call("daemon.status")["state"] == "running"
            time.sleep(0.05)
        daemon.wait_for_line("does not read its responses", after=mark, timeout=TIMEOUT)
        sender.join(TIMEOUT)
        assert not sender.is_alive()
        assert outcome and outcome[0].startswith("dropped"), outcome
    finally:
        hog.close()
        sender.join(TIMEOUT)
    with Client(daemon.socket) as client:
        assert client.call("daemon.status")["state"] == "running"
    assert daemon.stop() == 0
    assert_clean(daemon)


def test_every_line_is_answered_in_order_whatever_came_before(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon = daemon_factory(config(60))
    sock = connect(daemon.socket)
    reader = sock.makefile("rb")
    lines = [
        b'{"jsonrpc":"2.0","id":"\\ud800","method":"daemon.status"}\n',
        request_line("daemon.status", 1),
        b'{"jsonrpc":"2.0","id":2,"method":"daemon.st\\udc00tus"}\n',
        request_line("daemon.status", 3),
        b'{"jsonrpc":"2.0","id":4,"method":"runs.list","params":{"\\udfff":1}}\n',
        b'{"jsonrpc":"2.0","id":5,"method":"runs.list","params":{"reason":"a\\ud83d"}}\n',
        b'{"jsonrpc":"2.0","id":6,"method":"runs.list","params":{"limit":NaN}}\n',
        b'{"jsonrpc":"2.0","id":7,"method":"runs.list","params":{"offset":1e999}}\n',
        b'{"jsonrpc":"2.0","id":8,"method":"runs.list","params":{"offset":' + b"9" * 400
        + b"}}\n",
        b'{"jsonrpc":"2.0","id":9,"method":"runs.list","params":{"reason":"\xed\xa0\x80"}}\n',
        b'{"jsonrpc":"2.0","id":10,"method":"runs.enqueue","params":{"payload":'
        + b"[" * 500 + b"]" * 500 + b"}}\n",
        request_line("daemon.status", 11),
    ]
    try:
        sock.sendall(b"".join(lines))
        answers = [json.loads(reader.readline()) for _ in lines]
    finally:
        reader.close()
        sock.close()
    assert [a.get("result", {}).get("state") for a in answers if "result" in a] == \
        ["running"] * 3
    codes = [(a["id"], a["error"]["code"]) if "error" in a else (a["id"], "ok")
             for a in answers]
    assert codes == [(None, -32700), (1, "ok"), (None, -32700), (3, "ok"), (None, -32700),
                     (None, -32700), (None, -32700), (None, -32700), (8, -32602),
                     (None, -32700), (None, -32700), (11, "ok")]
    for answer in answers:
        if "error" in answer and answer["error"]["code"] == -32700 and answer["id"] is None:
            message = answer["error"]["message"]
            assert "invalid UTF-8 or unpaired surrogate" in message or "NaN" in message \
                or "out of range" in message or "nested too deeply" in message, message
    assert "params.offset" in answers[8]["error"]["message"]
    assert daemon.stop() == 0
    assert_clean(daemon)
