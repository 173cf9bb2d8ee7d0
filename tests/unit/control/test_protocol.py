"""JSON-RPC envelope, error codes, the method registry, and the server's drain.

The last tests run a real ControlServer on a unix socket in tmp_path (no
daemon around it) to pin the two-step shutdown down deterministically: a
request in progress finishes, new requests answer ``shutting_down``, the
status method still answers, and the listener closes.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from kandevd.control import protocol
from kandevd.control.client import Client, DaemonUnavailable, NoAnswer, RpcCallError
from kandevd.control.protocol import (
    AlreadyRunning,
    Conflict,
    InternalError,
    InvalidParams,
    InvalidRequest,
    MethodNotFound,
    NotFound,
    NotRunning,
    ParseError,
    Refused,
    RpcError,
    ShuttingDown,
    encode,
    failure,
    parse_request,
    success,
)
from kandevd.control.registry import Registry, object_schema, paging_properties
from kandevd.control.server import ControlServer
from kandevd.control.sockets import SocketInUse, socket_is_live

TIMEOUT = 10.0


def request(**fields: Any) -> bytes:
    return (json.dumps({"jsonrpc": "2.0", **fields}) + "\n").encode()


# -- parse_request ----------------------------------------------------------------------


def test_a_valid_request_and_a_notification() -> None:
    assert parse_request(request(id=7, method="daemon.status", params={"a": 1})) == \
        (7, "daemon.status", {"a": 1}, False)
    assert parse_request(request(id="x", method="m")) == ("x", "m", {}, False)
    assert parse_request(request(id=None, method="m", params=None)) == (None, "m", {}, False)
    assert parse_request(request(method="m")) == (None, "m", {}, True)


@pytest.mark.parametrize("line", [b"{not json\n", b'{"jsonrpc": "2.0",\n', b"\xff\xfe\n"])
def test_unparsable_lines_are_parse_errors(line: bytes) -> None:
    with pytest.raises(ParseError) as info:
        parse_request(line)
    assert info.value.code == -32700


@pytest.mark.parametrize("line", [b"[1]\n", b'"x"\n', b"1\n", b"null\n", b"[]\n"])
def test_a_json_value_that_is_not_an_object_is_an_invalid_request(line: bytes) -> None:
    with pytest.raises(InvalidRequest, match="must be a JSON object") as info:
        parse_request(line)
    assert info.value.code == -32600


@pytest.mark.parametrize(("message", "fragment"), [
    ({"jsonrpc": "1.0", "id": 1, "method": "m"}, '"jsonrpc" must be "2.0"'),
    ({"id": 1, "method": "m"}, '"jsonrpc" must be "2.0"'),
    ({"jsonrpc": "2.0", "id": 1}, '"method" must be a non-empty string'),
    ({"jsonrpc": "2.0", "id": 1, "method": ""}, '"method" must be a non-empty string'),
    ({"jsonrpc": "2.0", "id": 1, "method": 5}, '"method" must be a non-empty string'),
    ({"jsonrpc": "2.0", "id": True, "method": "m"}, "id must be"),
    ({"jsonrpc": "2.0", "id": {"a": 1}, "method": "m"}, "id must be"),
    ({"jsonrpc": "2.0", "id": 1, "method": "m", "extra": 1}, "unknown member"),
])
def test_malformed_envelopes_are_invalid_requests(message: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidRequest, match=fragment):
        parse_request(json.dumps(message).encode())


def test_the_id_is_kept_when_it_was_readable() -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_request(json.dumps({"jsonrpc": "1.0", "id": 42, "method": "m"}).encode())
    assert info.value.extra == {"id": 42}


def test_positional_params_are_invalid_params() -> None:
    with pytest.raises(InvalidParams, match="params must be a JSON object") as info:
        parse_request(request(id=1, method="m", params=[1, 2]))
    assert info.value.code == -32602


# -- the envelope and the error set -----------------------------------------------------


@pytest.mark.parametrize(("cls", "code", "kind"), [
    (ParseError, -32700, "parse_error"), (InvalidRequest, -32600, "invalid_request"),
    (MethodNotFound, -32601, "method_not_found"), (InvalidParams, -32602, "invalid_params"),
    (InternalError, -32603, "internal"), (NotFound, -32000, "not_found"),
    (Conflict, -32000, "conflict"), (Refused, -32000, "refused"),
    (ShuttingDown, -32000, "shutting_down"), (NotRunning, -32000, "not_running"),
    (AlreadyRunning, -32000, "already_running"),
])
def test_every_error_class_has_its_contract_code_and_kind(
        cls: type[RpcError], code: int, kind: str) -> None:
    error = cls("something", data={"id_hint": 3})
    assert error.to_error() == {"code": code, "message": "something",
                                "data": {"kind": kind, "id_hint": 3}}
    assert failure(9, error) == {"jsonrpc": "2.0", "id": 9, "error": error.to_error()}


def test_success_and_encode_frame_one_compact_line() -> None:
    line = encode(success(1, {"name": "café", "n": [1, 2]}))
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line) == {"jsonrpc": "2.0", "id": 1, "result": {"name": "café", "n": [1, 2]}}
    assert "café".encode() in line  # UTF-8, not \\u escapes
    assert protocol.MAX_LINE_BYTES == 1024 * 1024


# -- the registry ------------------------------------------------------------------------------


@pytest.fixture
def registry() -> Registry:
    reg = Registry()
    reg.add("things.get", lambda p: {"got": p["id"]},
            object_schema({"id": {"type": "string"}, **paging_properties()}, ("id",)))
    return reg


def test_unknown_method_and_duplicate_registration(registry: Registry) -> None:
    with pytest.raises(MethodNotFound, match="unknown method: nope"):
        registry.get("nope")
    with pytest.raises(ValueError, match="registered twice"):
        registry.add("things.get", lambda p: p)
    with pytest.raises(jsonschema.SchemaError):
        registry.add("bad.schema", lambda p: p, {"type": "no-such-type"})
    assert registry.names() == ["things.get"]


@pytest.mark.parametrize(("params", "fragment"), [
    ({"id": "a", "bogus": 1}, "params.bogus: unknown parameter"),
    ({"id": 5}, "params.id: 5 is not of type 'string'"),
    ({}, "'id' is a required property"),
    ({"id": "a", "limit": 501}, "params.limit: 501 is greater than the maximum of 500"),
    ({"id": "a", "offset": -1}, "params.offset: -1 is less than the minimum of 0"),
])
def test_params_are_checked_against_the_schema(registry: Registry, params: dict[str, Any],
                                               fragment: str) -> None:
    with pytest.raises(InvalidParams) as info:
        registry.check_params(registry.get("things.get"), params)
    assert fragment in info.value.message


def test_a_long_or_null_value_is_refused_with_its_reason_in_json_words() -> None:
    reg = Registry()
    reg.add("things.make", lambda p: p, object_schema(
        {"by": {"type": "string", "maxLength": 200}, "n": {"type": "integer"}}, ()))
    with pytest.raises(InvalidParams) as info:
        reg.check_params(reg.get("things.make"), {"by": "x" * 5000})
    assert info.value.message == (f"params.by: '{'x' * 40}'... (5000 characters) is too long"
                                  " (at most 200 characters)")
    with pytest.raises(InvalidParams) as info:
        reg.check_params(reg.get("things.make"), {"n": None})
    assert info.value.message == "params.n: null is not of type 'integer'"
    with pytest.raises(InvalidParams) as info:
        reg.check_params(reg.get("things.make"), {"n": list(range(300))})
    assert info.value.message == "params.n: a list of 300 items is not of type 'integer'"


def test_a_pattern_with_its_own_words_is_refused_in_them_not_as_a_regular_expression() -> None:
    reg = Registry()
    name = {"type": "string", "pattern": r"^[a-z]+$", "x-message": "is not a plain name"}
    reg.add("things.make", lambda p: p, object_schema({"name": name}, ("name",)))
    with pytest.raises(InvalidParams) as info:
        reg.check_params(reg.get("things.make"), {"name": "../x"})
    assert info.value.message == "params.name: '../x' is not a plain name"


# -- a real ControlServer: drain, listener, errors ---------------------------------------------


class Blocking:
    """A handler that parks until released, so a request is 'in progress'."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, _params: dict[str, Any]) -> dict[str, Any]:
        self.entered.set()
        assert self.release.wait(TIMEOUT)
        return {"slow": "done"}


@pytest.fixture
def server(tmp_path: Path):
    registry = Registry()
    slow = Blocking()
    registry.add("test.status", lambda p: {"ok": True}, allowed_while_stopping=True)
    registry.add("test.slow", slow)
    registry.add("test.other", lambda p: {"other": True})

    def broken(_params: dict[str, Any]) -> None:
        raise KeyError("secret detail")

    registry.add("test.broken", broken)
    srv = ControlServer(tmp_path / "t.sock", registry)
    srv.start()
    srv.slow = slow  # type: ignore[attr-defined]
    yield srv
    slow.release.set()
    srv.close()


def test_socket_is_0600_and_a_live_one_is_never_stolen(server: ControlServer,
                                                       tmp_path: Path) -> None:
    assert stat.S_ISSOCK(server.path.stat().st_mode)
    assert stat.S_IMODE(server.path.stat().st_mode) == 0o600
    assert socket_is_live(server.path)
    with pytest.raises(SocketInUse):
        ControlServer(server.path, Registry()).start()
    assert not list(tmp_path.glob(".t.sock.*.tmp"))  # the temp name was renamed away


def test_a_stale_socket_file_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "stale.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # the file stays, nothing listens: what a kill -9 leaves behind
    assert path.exists() and not socket_is_live(path)
    srv = ControlServer(path, Registry())
    srv.start()
    try:
        assert socket_is_live(path)
    finally:
        srv.close()
    assert not path.exists()


def test_an_internal_error_never_leaks_a_traceback(server: ControlServer,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    with Client(server.path) as client, pytest.raises(RpcCallError) as info:
        client.call("test.broken")
    assert info.value.error == {"code": -32603, "message": "internal error",
                                "data": {"kind": "internal"}}
    assert any("method test.broken failed" in r.getMessage() and r.exc_info
               for r in caplog.records)


def test_drain_finishes_work_in_progress_then_answers_shutting_down(
        server: ControlServer) -> None:
    slow = server.slow  # type: ignore[attr-defined]
    early = Client(server.path)  # connected before the drain
    busy = Client(server.path)
    answers: list[Any] = []
    caller = threading.Thread(target=lambda: answers.append(busy.call("test.slow")))
    caller.start()
    assert slow.entered.wait(TIMEOUT)

    drainer = threading.Thread(target=server.begin_drain)
    drainer.start()
    drainer.join(0.2)
    assert drainer.is_alive()  # it waits for the request in progress
    assert server.draining
    with pytest.raises(RpcCallError) as info:
        early.call("test.other")
    assert info.value.code == -32000 and info.value.kind == "shutting_down"
    assert early.call("test.status") == {"ok": True}  # status still answers

    slow.release.set()
    caller.join(TIMEOUT)
    drainer.join(TIMEOUT)
    assert answers == [{"slow": "done"}] and not drainer.is_alive()
    with pytest.raises(DaemonUnavailable):
        Client(server.path)  # the listener is closed: no new connections
    assert early.call("test.status") == {"ok": True}  # open connections live until close()
    server.close()
    with pytest.raises(DaemonUnavailable):
        early.call("test.status")
    early.close()
    busy.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("kandevd-control")]


PEER_SCRIPT = """
import socket, sys
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
conn.connect(sys.argv[1])
print(conn.makefile("r").readline(), end="")  # refused at once, before any request
"""


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/usr/bin/python3").exists(),
                    reason="needs root to run a client as another uid")
def test_a_connection_from_another_uid_is_refused() -> None:
    """SO_PEERCRED: even with the socket file opened up, a foreign uid gets `refused`."""
    folder = Path(tempfile.mkdtemp(prefix="kandevd-peer-"))
    try:
        folder.chmod(0o755)
        registry = Registry()
        registry.add("test.status", lambda p: {"ok": True}, allowed_while_stopping=True)
        srv = ControlServer(folder / "peer.sock", registry)
        srv.start()
        try:
            srv.path.chmod(0o666)  # loosened on purpose, to reach the uid check behind it
            child = subprocess.run(["/usr/bin/python3", "-I", "-c", PEER_SCRIPT, str(srv.path)],
                                   user=65534, group=65534, cwd="/", env={},
                                   capture_output=True, text=True, timeout=TIMEOUT)
            assert child.returncode == 0, child.stderr
            error = json.loads(child.stdout)["error"]
            assert error["data"]["kind"] == "refused" and "uid" in error["message"]
            with Client(srv.path) as mine:  # the owner is still served
                assert mine.call("test.status") == {"ok": True}
        finally:
            srv.close()
    finally:
        shutil.rmtree(folder)


def test_deeply_nested_json_is_a_parse_error_not_a_crash() -> None:
    from kandevd.control.protocol import ParseError, parse_request

    line = b'{"jsonrpc":"2.0","id":1,"method":"x","params":{"a":' + b"[" * 100_000 + b"]" * \
        100_000 + b"}}"
    with pytest.raises(ParseError, match="nested too deeply"):
        parse_request(line)


@pytest.mark.parametrize(("payload", "fragment"), [
    ('{"x": NaN}', "NaN is not a JSON number"),
    ('{"x": -Infinity}', "-Infinity is not a JSON number"),
    ('{"x": 1e999}', "out of range"),
    ('{"x": "\\ud800"}', "lone surrogate \\ud800"),
    ('{"\\udfff": 1}', "lone surrogate \\udfff"),
])
def test_values_no_strict_reader_could_take_back_are_parse_errors(payload: str,
                                                                  fragment: str) -> None:
    line = ('{"jsonrpc": "2.0", "id": 1, "method": "m", "params": ' + payload + "}\n").encode()
    with pytest.raises(ParseError) as info:
        parse_request(line)
    assert fragment in info.value.message


def test_a_surrogate_pair_is_one_valid_character() -> None:
    line = b'{"jsonrpc": "2.0", "id": 1, "method": "m", "params": {"x": "\\ud83d\\ude00"}}\n'
    assert parse_request(line)[2] == {"x": "\U0001F600"}


# -- hostile inputs and clients ------------------------------------------------------------


@pytest.mark.parametrize("line", [
    b'{"jsonrpc":"2.0","id":"\\ud800","method":"m"}',
    b'{"jsonrpc":"2.0","id":1,"method":"m\\uDC00"}',
    b'{"jsonrpc":"2.0","id":1,"method":"m","params":{"\\udbff":1}}',
    b'{"jsonrpc":"2.0","id":1,"method":"m","params":{"a":["x\\ud800y"]}}',
    b'{"jsonrpc":"2.0","id":1,"method":"m","params":{"a":"\xed\xa0\x80"}}',
    b'{"jsonrpc":"2.0","id":1,"method":"m","params":{"a":"\xff"}}',
])
def test_lone_surrogates_and_bad_utf8_anywhere_are_precise_parse_errors(line: bytes) -> None:
    with pytest.raises(ParseError) as info:
        parse_request(line)
    assert "invalid UTF-8 or unpaired surrogate" in info.value.message
    assert info.value.extra == {}  # no id could be trusted


def test_nesting_beyond_max_depth_is_a_parse_error() -> None:
    def nested(depth: int) -> bytes:  # the envelope and params are two levels
        return (b'{"jsonrpc":"2.0","id":1,"method":"m","params":{"a":' + b"[" * (depth - 2)
                + b"]" * (depth - 2) + b"}}")

    assert parse_request(nested(protocol.MAX_DEPTH))[0] == 1
    with pytest.raises(ParseError, match="nested too deeply"):
        parse_request(nested(protocol.MAX_DEPTH + 1))
    wide = b'{"jsonrpc":"2.0","id":1,"method":"m","params":{"a":' + b"[[]," * 500 + \
        b"[]" + b"]" * 500 + b"}}"
    with pytest.raises(ParseError, match="nested too deeply"):
        parse_request(wide)
    flat = b'{"jsonrpc":"2.0","id":1,"method":"m","params":{"a":[' + b"[]," * 500 + b"[]]}}"
    assert len(parse_request(flat)[2]["a"]) == 501


def test_encode_never_writes_non_standard_json() -> None:
    with pytest.raises(ValueError):
        encode(success(1, {"x": float("nan")}))
    with pytest.raises(ValueError):
        encode(success(1, {"x": "\ud800"}))


def test_long_error_messages_are_cut() -> None:
    error = InvalidParams("x" * 100_000).to_error()
    assert len(error["message"]) < 2100 and error["message"].endswith("(truncated)")


def test_integral_floats_of_integer_params_become_ints() -> None:
    reg = Registry()
    reg.add("m", lambda p: p, object_schema({"count": {"type": "integer", "maximum": 9},
                                             "ratio": {"type": "number"}}))
    params = {"count": 2.0, "ratio": 2.0}
    reg.check_params(reg.get("m"), params)
    assert params == {"count": 2, "ratio": 2.0}
    assert type(params["count"]) is int and type(params["ratio"]) is float


def test_a_database_error_is_unavailable_and_logged_once_without_traceback(
        server: ControlServer, caplog: pytest.LogCaptureFixture) -> None:
    import sqlite3

    server.registry.add("test.db", lambda p: (_ for _ in ()).throw(
        sqlite3.OperationalError("database is locked")))
    with Client(server.path) as client:
        for _ in range(3):
            with pytest.raises(RpcCallError) as info:
                client.call("test.db")
            assert info.value.error == {"code": -32000,
                                        "message": "database unavailable: database is locked",
                                        "data": {"kind": "unavailable"}}
    logged = [r for r in caplog.records if "database unavailable" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is None


def read_answer(sock: socket.socket) -> dict[str, Any]:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return json.loads(data)


def test_at_the_cap_the_longest_idle_connection_makes_room(tmp_path: Path) -> None:
    registry = Registry()
    registry.add("test.status", lambda p: {"ok": True})
    srv = ControlServer(tmp_path / "c.sock", registry, max_connections=3)
    srv.start()
    socks = []
    try:
        for _ in range(3):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(TIMEOUT)
            sock.connect(str(srv.path))
            socks.append(sock)
        # An answer proves the connection was admitted; 1, then 2, then 0 were active last.
        for index in (1, 2, 0):
            socks[index].sendall(request(id=0, method="test.status"))
            assert read_answer(socks[index])["result"] == {"ok": True}
        with Client(srv.path, timeout=TIMEOUT) as newcomer:
            assert newcomer.call("test.status") == {"ok": True}
            assert socks[1].recv(10) == b""  # the longest idle one was closed
            socks[0].sendall(request(id=1, method="test.status"))
            assert read_answer(socks[0])["id"] == 1
        assert srv.connections_evicted == 1
    finally:
        for sock in socks:
            sock.close()
        srv.close()


def test_when_every_connection_is_busy_a_reserved_slot_serves_status_and_shutdown(
        tmp_path: Path) -> None:
    registry = Registry()
    slow = Blocking()
    registry.add("daemon.status", lambda p: {"ok": True}, allowed_while_stopping=True)
    registry.add("daemon.shutdown", lambda p: {"bye": True})
    registry.add("test.slow", slow)
    srv = ControlServer(tmp_path / "r.sock", registry, max_connections=1,
                        reserved_connections=1)
    srv.start()
    busy = Client(srv.path, timeout=TIMEOUT)
    caller = threading.Thread(target=busy.call, args=("test.slow",))
    caller.start()
    try:
        assert slow.entered.wait(TIMEOUT)
        with Client(srv.path, timeout=TIMEOUT) as limited:
            assert limited.call("daemon.status") == {"ok": True}
            with pytest.raises(RpcCallError) as info:
                limited.call("test.slow")
            assert info.value.kind == "refused" and "daemon.status" in str(info.value)
            with Client(srv.path, timeout=TIMEOUT) as second:  # the reserved slot is reused
                assert second.call("daemon.shutdown") == {"bye": True}
    finally:
        slow.release.set()
        caller.join(TIMEOUT)
        busy.close()
        srv.close()


def test_an_idle_connection_is_closed_and_a_non_reader_dropped(tmp_path: Path) -> None:
    import time

    registry = Registry()
    registry.add("test.big", lambda p: {"blob": "x" * 100_000})
    srv = ControlServer(tmp_path / "i.sock", registry, idle_timeout_s=0.3)
    srv.start()
    try:
        assert srv.send_timeout_s == 0.3
        idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        idle.settimeout(TIMEOUT)
        idle.connect(str(srv.path))
        start = time.monotonic()
        idle.sendall(b'{"jsonrpc":')  # a partial line does not keep it open
        assert idle.recv(10) == b""
        assert 0.2 < time.monotonic() - start < 5
        idle.close()

        hog = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        hog.settimeout(TIMEOUT)
        hog.connect(str(srv.path))
        with pytest.raises(OSError):
            for _ in range(1000):  # 100 MB of answers never read
                hog.sendall(request(id=1, method="test.big") * 10)
        hog.close()
        with Client(srv.path, timeout=TIMEOUT) as other:
            assert other.call("test.big")["blob"][:3] == "xxx"
    finally:
        srv.close()


def test_the_client_reconnects_once_when_its_idle_connection_was_closed(
        tmp_path: Path) -> None:
    registry = Registry()
    calls: list[int] = []
    registry.add("test.count", lambda p: calls.append(1) or {"n": len(calls)})
    srv = ControlServer(tmp_path / "k.sock", registry, idle_timeout_s=0.2)
    srv.start()
    try:
        with Client(srv.path, timeout=TIMEOUT) as client:
            assert client.call("test.count") == {"n": 1}
            pause = threading.Event()
            while srv.connection_count():  # the daemon closes it after 0.2 s idle
                pause.wait(0.05)
            assert client.call("test.count") == {"n": 2}  # sent once, on a new connection
        assert calls == [1, 1]
    finally:
        srv.close()


def test_a_daemon_that_takes_a_request_and_never_answers_is_told_apart(
        tmp_path: Path) -> None:
    """Not 'no daemon listens' nor 'it is stopping': it took the request (busy, or
    waiting for its database)."""
    path = tmp_path / "s.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()
    done = threading.Event()
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: (accepted.append(listener.accept()[0]), done.wait(10)),
                     daemon=True).start()
    try:
        with pytest.raises(NoAnswer, match=r"took the request but gave no answer within 0\.2s"):
            Client(path, timeout=0.2).call("daemon.status")
    finally:
        done.set()
        for conn in accepted:
            conn.close()
        listener.close()
    assert issubclass(NoAnswer, DaemonUnavailable)  # (exit 69, as before)
