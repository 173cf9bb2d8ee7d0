"""The control socket of a real daemon: framing, error codes, isolation, the drain.

Each malformed input is sent on a raw connection; the test then proves the
daemon still serves, on that connection when the contract keeps it open and
always on a second one.
"""

from __future__ import annotations

import json
import signal
import socket
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kandevd.control.client import Client, DaemonUnavailable, RpcCallError
from tests.support.daemon import (
    FAST_CONFIG,
    STARTED,
    DaemonProcess,
    blocked_stop_daemon,
    run_cli,
)

pytestmark = pytest.mark.integration

TIMEOUT = 30.0


class Raw:
    """A bare connection: send exact bytes, read exact lines."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(TIMEOUT)
        self.sock.connect(str(path))
        self.reader = self.sock.makefile("rb")

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def line(self) -> bytes:
        try:
            return self.reader.readline()
        except ConnectionResetError:
            return b""  # the daemon closed with our unread bytes still queued

    def response(self) -> dict[str, Any]:
        raw = self.line()
        assert raw.endswith(b"\n"), raw
        return json.loads(raw)

    def request(self, method: str, params: Any = None, request_id: Any = 1) -> dict[str, Any]:
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id, "method": method}
        if params is not None:
            message["params"] = params
        self.send((json.dumps(message) + "\n").encode())
        return self.response()

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One daemon shared by the protocol tests: they must not disturb each other."""
    process = DaemonProcess(tmp_path_factory.mktemp("socket") / "home", FAST_CONFIG)
    process.start()
    yield process
    try:
        assert process.stop() == 0
        assert "Traceback" not in process.log_text
    finally:
        process.cleanup()


def still_serving(daemon: DaemonProcess) -> None:
    """A fresh connection answers daemon.status: the daemon survived what came before."""
    with Client(daemon.socket) as other:
        assert other.call("daemon.status")["state"] == "running"


BAD_REQUESTS = [
    pytest.param(b"{this is not json\n", -32700, "parse_error", None, id="malformed"),
    pytest.param(b"\xff\xfe\xfd\n", -32700, "parse_error", None, id="not-utf8"),
    pytest.param(b"[1]\n", -32600, "invalid_request", None, id="array"),
    pytest.param(b'"x"\n', -32600, "invalid_request", None, id="string"),
    pytest.param(b'{"jsonrpc":"1.0","id":4,"method":"daemon.status"}\n', -32600,
                 "invalid_request", 4, id="wrong-version"),
    pytest.param(b'{"jsonrpc":"2.0","id":5,"method":"no.such.method"}\n', -32601,
                 "method_not_found", 5, id="unknown-method"),
    pytest.param(b'{"jsonrpc":"2.0","id":6,"method":"daemon.status","params":{"bogus":1}}\n',
                 -32602, "invalid_params", 6, id="unknown-param"),
    pytest.param(b'{"jsonrpc":"2.0","id":"s","method":"runs.get","params":{"id":5}}\n',
                 -32602, "invalid_params", "s", id="wrong-type"),
    pytest.param(b'{"jsonrpc":"2.0","id":8,"method":"runs.get","params":[1]}\n',
                 -32602, "invalid_params", 8, id="positional-params"),
]


@pytest.mark.parametrize(("line", "code", "kind", "request_id"), BAD_REQUESTS)
def test_a_bad_request_gets_its_error_and_the_connection_stays_usable(
        daemon: DaemonProcess, line: bytes, code: int, kind: str, request_id: Any) -> None:
    raw = Raw(daemon.socket)
    try:
        raw.send(line)
        answer = raw.response()
        assert answer["jsonrpc"] == "2.0" and answer["id"] == request_id
        assert answer["error"]["code"] == code
        assert answer["error"]["data"]["kind"] == kind
        assert "Traceback" not in answer["error"]["message"]
        assert raw.request("daemon.status", request_id=99)["result"]["state"] == "running"
    finally:
        raw.close()
    still_serving(daemon)


def test_a_line_over_1_mib_gets_invalid_request_and_the_connection_closes(
        daemon: DaemonProcess) -> None:
    raw = Raw(daemon.socket)
    huge = b'{"jsonrpc":"2.0","id":1,"method":"daemon.status","params":{"x":"' + \
        b"a" * (2 * 1024 * 1024) + b'"}}\n'
    send_errors: list[OSError] = []

    def sender() -> None:  # the daemon stops reading after 1 MiB: our send may block or break
        try:
            raw.send(huge)
        except OSError as exc:
            send_errors.append(exc)

    thread = threading.Thread(target=sender)
    thread.start()
    try:
        answer = raw.response()
        assert answer["error"]["code"] == -32600
        assert answer["error"]["data"]["kind"] == "invalid_request"
        assert "1 MiB" in answer["error"]["message"]
        assert raw.line() == b""  # closed by the daemon
        thread.join(TIMEOUT)
        assert not thread.is_alive()
    finally:
        raw.close()
    still_serving(daemon)


def test_a_line_just_under_the_limit_is_accepted(daemon: DaemonProcess) -> None:
    prefix = b'{"jsonrpc":"2.0","id":1,"method":"runs.get","params":{"id":"'
    suffix = b'"}}\n'
    filler = 1024 * 1024 - len(prefix) - len(suffix)
    raw = Raw(daemon.socket)
    try:
        raw.send(prefix + b"r" * filler + suffix)  # exactly 1 MiB with its newline
        answer = raw.response()
        assert answer["error"]["data"]["kind"] == "invalid_params"  # id too long: schema
        assert raw.request("daemon.status")["result"]["state"] == "running"
    finally:
        raw.close()


def test_many_pipelined_requests_on_one_connection_keep_their_ids(
        daemon: DaemonProcess) -> None:
    raw = Raw(daemon.socket)
    try:
        batch = b"".join(
            (json.dumps({"jsonrpc": "2.0", "id": i, "method": "daemon.status"}) + "\n").encode()
            for i in ("a", 2, 3.5))
        notification = b'{"jsonrpc":"2.0","method":"daemon.status"}\n'  # no id: no answer
        raw.send(b"\n  \n" + notification + batch)  # blank lines are skipped
        answers = [raw.response() for _ in range(3)]
        assert [a["id"] for a in answers] == ["a", 2, 3.5]
        assert all(a["result"]["state"] == "running" for a in answers)
    finally:
        raw.close()


def test_several_connections_are_served_at_once(daemon: DaemonProcess) -> None:
    clients = [Raw(daemon.socket) for _ in range(5)]
    try:
        for n, client in enumerate(clients):
            assert client.request("daemon.status", request_id=n)["id"] == n
    finally:
        for client in clients:
            client.close()


def test_socket_is_0600(daemon: DaemonProcess) -> None:
    # The home's own mode is kandevd/paths.py's business: the harness creates the
    # home before the daemon starts, and an existing home keeps the mode it has.
    mode = daemon.socket.stat().st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    assert not list(daemon.home.glob(".kandevd.sock.*"))  # the temp bind name is gone


def test_a_home_too_deep_for_a_socket_path_still_serves_its_socket(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    """A unix socket path fits in 107 bytes; a deeper home is served all the same."""
    home = tmp_path / ("h" * 60) / ("o" * 60) / "home"
    assert len(str(home / "kandevd.sock")) > 107
    daemon = daemon_factory(FAST_CONFIG, home=home)
    assert daemon.call("daemon.status")["state"] == "running"
    assert stat.S_IMODE(daemon.socket.stat().st_mode) == 0o600
    shown = run_cli(home, "status")
    assert shown.returncode == 0, shown.stderr
    assert "running" in shown.stdout


def test_during_shutdown_methods_answer_shutting_down_but_status_answers(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    stopping, _run_id = blocked_stop_daemon(daemon_factory)
    early = Client(stopping.socket)  # opened before the signal
    try:
        stopping.send_signal(signal.SIGTERM)
        stopping.wait_for_line(STARTED)
        # Intake goes off first, then the loops stop; the runtime then waits for the agent.
        stopping.wait_until(lambda: early.call("daemon.status")["loops"]["queue"] == "stopped",
                            what="the queue loop stopped")
        status = early.call("daemon.status")
        assert status["state"] == "stopping" and status["runtime"]["active"] == 1
        for method, params in [("runs.list", {}), ("daemon.shutdown", {}),
                               ("workspaces.create", {"name": "too late"})]:
            with pytest.raises(RpcCallError) as info:
                early.call(method, params)
            assert info.value.code == -32000 and info.value.kind == "shutting_down", method
        with pytest.raises(DaemonUnavailable):
            Client(stopping.socket)  # the listener is closed: no new connections
        assert early.call("daemon.status")["state"] == "stopping"
    finally:
        early.close()
    stopping.send_signal(signal.SIGTERM)  # end the 60 s wait: forced exit
    assert stopping.wait() == 1
