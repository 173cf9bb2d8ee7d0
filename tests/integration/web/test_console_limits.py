"""What an anonymous client can cost the daemon through the console: a small, fixed amount.

Through the real daemon: huge bodies and headers without the token leave its peak
memory where it was; clients that trickle their requests hold no worker, so the
console answers a signed-in browser meanwhile; a request that is not whole in time
is cut off; a crowd of idle connections makes room for a real one.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kandevd.net.httpintake import MAX_GATHERING, REQUEST_DEADLINE_S
from tests.support.console import ConsoleAddress, console_of, request, sign_in
from tests.support.daemon import FAST_CONFIG, DaemonProcess

pytestmark = pytest.mark.integration

MIB = 1024 * 1024


@pytest.fixture
def console(daemon_factory: Callable[..., DaemonProcess]
            ) -> tuple[DaemonProcess, ConsoleAddress]:
    daemon = daemon_factory({**FAST_CONFIG, "web": {"listen": "127.0.0.1:0"}})
    return daemon, console_of(daemon)


def peak_rss(daemon: DaemonProcess) -> int:
    """The daemon's peak resident memory so far (bytes)."""
    assert daemon.proc is not None
    for line in Path(f"/proc/{daemon.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def connect(address: ConsoleAddress) -> socket.socket:
    return socket.create_connection(("127.0.0.1", address.port), timeout=30)


def send_until_refused(address: ConsoleAddress, head: bytes, size: int) -> bytes:
    """Send ``head`` then ``size`` bytes; what the console answered before it hung up."""
    block = b"a" * MIB
    with connect(address) as sock:
        try:
            sock.sendall(head)
            for _ in range(size // MIB):
                sock.sendall(block)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before the end: what this test wants
        try:
            return sock.recv(4096)
        except ConnectionResetError:
            return b""


def test_huge_bodies_and_headers_without_the_token_cost_no_memory(
        console: tuple[DaemonProcess, ConsoleAddress]) -> None:
    daemon, address = console
    cookie = sign_in(address)
    assert request(address, "GET", "/schedules", cookie=cookie).status == 200
    before = peak_rss(daemon)
    host = address.host.encode()
    body = send_until_refused(address, b"POST /schedules/pause HTTP/1.1\r\nHost: " + host +
                              b"\r\nContent-Type: application/x-www-form-urlencoded\r\n"
                              b"Content-Length: %d\r\n\r\n" % (400 * MIB), 400 * MIB)
    assert body.startswith(b"HTTP/1.1 413"), body[:200]
    chunked = send_until_refused(address, b"POST /schedules/pause HTTP/1.1\r\nHost: " + host +
                                 b"\r\nTransfer-Encoding: chunked\r\n\r\n" +
                                 b"%x\r\n" % (400 * MIB), 400 * MIB)
    assert chunked == b"" or chunked.startswith(b"HTTP/1.1 4"), chunked[:200]
    header = send_until_refused(address, b"GET / HTTP/1.1\r\nHost: " + host + b"\r\nX-Big: ",
                                100 * MIB)
    assert header == b"" or header.startswith(b"HTTP/1.1 4"), header[:200]
    line = send_until_refused(address, b"GET /", 100 * MIB)  # a request line with no end
    assert line == b"" or line.startswith(b"HTTP/1.1 4"), line[:200]
    assert peak_rss(daemon) - before < 64 * MIB
    assert request(address, "GET", "/schedules", cookie=cookie).status == 200
    assert daemon.proc is not None and daemon.proc.poll() is None


@pytest.fixture
def tricklers(console: tuple[DaemonProcess, ConsoleAddress]) -> Iterator[list[socket.socket]]:
    """40 clients each sending the start of a request and then a byte a second."""
    _daemon, address = console
    socks = [connect(address) for _ in range(40)]
    stop = threading.Event()
    for sock in socks:
        sock.sendall(b"GET /schedules HTTP/1.1\r\n")

    def trickle() -> None:
        while not stop.wait(1.0):
            for sock in socks:
                try:
                    sock.send(b"X")
                except OSError:
                    pass
    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    yield socks
    stop.set()
    thread.join()
    for sock in socks:
        sock.close()


def test_slow_clients_hold_no_worker(console: tuple[DaemonProcess, ConsoleAddress],
                                     tricklers: list[socket.socket]) -> None:
    _daemon, address = console
    cookie = sign_in(address)
    for _ in range(5):
        started = time.monotonic()
        answer = request(address, "GET", "/schedules", cookie=cookie)
        assert answer.status == 200
        assert time.monotonic() - started < 3.0
        time.sleep(0.5)  # (spread over the tricklers' bytes)


AMBIGUOUS = [b"Content-Length: 1\r\nContent-Length: 100000\r\n",
             b"Content-Length: +100\r\n",
             # (more than 100 headers: Python's own header parser gave up on them)
             b"X-Pad: 1\r\n" * 101 + b"Content-Length: 1\r\nContent-Length: 100000\r\n"]


def test_a_request_of_ambiguous_length_is_refused_at_once_and_holds_no_worker(
        console: tuple[DaemonProcess, ConsoleAddress]) -> None:
    """cheroot took the last of two lengths (or "+100") and waited for a body in a worker
    thread: 14 anonymous clients sending a byte now and then held all 12 workers."""
    _daemon, address = console
    host = b"Host: 127.0.0.1:%d\r\n" % address.port
    holders = []
    try:
        for index in range(14):
            sock = connect(address)
            holders.append(sock)
            sock.sendall(b"POST /login HTTP/1.1\r\n" + host + AMBIGUOUS[index % 3]
                         + b"Content-Type: application/x-www-form-urlencoded\r\n\r\nt")
        for sock in holders:
            sock.settimeout(5.0)
            answer = sock.recv(4096)
            assert answer.startswith(b"HTTP/1.1 400 Bad Request"), answer
            assert b"Content-Length" in answer
            try:
                sock.send(b"t")  # (closed after the answer: nothing more is read)
            except OSError:
                pass
        for _ in range(14):  # a length cheroot reads (a space before the colon): gathered
            sock = connect(address)
            holders.append(sock)
            sock.sendall(b"POST /login HTTP/1.1\r\n" + host + b"Content-Length : 100000"
                         b"\r\nContent-Type: application/x-www-form-urlencoded\r\n\r\nt")
        cookie = sign_in(address)
        started = time.monotonic()
        assert request(address, "GET", "/agents", cookie=cookie).status == 200
        assert time.monotonic() - started < 3.0
        with connect(address) as sock:  # two Host headers: which was meant?
            sock.sendall(b"GET /agents HTTP/1.1\r\nHost: evil.example\r\n" + host + b"\r\n")
            sock.settimeout(5.0)
            assert sock.recv(4096).startswith(b"HTTP/1.1 400 Bad Request")
    finally:
        for sock in holders:
            sock.close()


def test_a_request_not_whole_in_time_is_cut_off(
        console: tuple[DaemonProcess, ConsoleAddress]) -> None:
    _daemon, address = console
    with connect(address) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n")
        started = time.monotonic()
        ended = False
        while time.monotonic() - started < REQUEST_DEADLINE_S + 40:
            try:
                sock.send(b"X")
                sock.settimeout(1.0)
                if sock.recv(4096) == b"":
                    ended = True
                    break
            except TimeoutError:
                continue
            except OSError:
                ended = True
                break
        assert ended, "the console kept a request that trickled in past its deadline"
        assert time.monotonic() - started >= REQUEST_DEADLINE_S - 1


def test_idle_connections_make_room_for_a_real_one(
        console: tuple[DaemonProcess, ConsoleAddress]) -> None:
    daemon, address = console
    cookie = sign_in(address)
    idle = [connect(address) for _ in range(3 * MAX_GATHERING)]
    try:
        for sock in idle[: MAX_GATHERING]:
            sock.sendall(b"GET / HTTP/1.1\r\n")
        started = time.monotonic()
        assert request(address, "GET", "/schedules", cookie=cookie).status == 200
        assert time.monotonic() - started < 3.0
        assert len(list(Path(f"/proc/{daemon.proc.pid}/fd").iterdir())) < 3 * MAX_GATHERING
    finally:
        for sock in idle:
            sock.close()


def test_a_planted_cookie_of_the_same_name_locks_nobody_out(
        console: tuple[DaemonProcess, ConsoleAddress]) -> None:
    _daemon, address = console
    right = sign_in(address)
    planted = f"{address.cookie_name}=from-another-program"
    assert request(address, "GET", "/", cookie=f"{planted}; {right}").status == 200
    assert request(address, "GET", "/", cookie=planted).status == 401
    # Another console's cookie (another port) does not sign in to this one.
    _name, value = right.split("=", 1)
    assert request(address, "GET", "/", cookie=f"kandevd_console_1={value}").status == 401


def test_a_signed_in_connection_is_kept_an_anonymous_one_is_not(
        console: tuple[DaemonProcess, ConsoleAddress]) -> None:
    _daemon, address = console
    cookie = sign_in(address)
    host = address.host.encode()
    with connect(address) as sock:
        get = b"GET /schedules HTTP/1.1\r\nHost: " + host + b"\r\nCookie: " + \
            cookie.encode() + b"\r\n\r\n"
        sock.sendall(get + get)  # two requests in one write: both answered
        seen = b""
        while seen.count(b"HTTP/1.1 200") < 2:
            chunk = sock.recv(65536)
            assert chunk, seen[-300:]
            seen += chunk
    with connect(address) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: " + host + b"\r\n\r\n")
        seen = b""
        while chunk := sock.recv(65536):
            seen += chunk
        assert seen.startswith(b"HTTP/1.1 401") and b"Connection: close" in seen
