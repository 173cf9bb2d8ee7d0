"""The unix socket's mechanics: who is on the other end, is a socket file live, and sends
and receives bounded by timeouts the kernel keeps."""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path

from kandevd.net import unixaddr

_UCRED = struct.Struct("3i")


class SocketInUse(RuntimeError):
    def __init__(self, path: Path) -> None:
        super().__init__(f"another process is serving {path}")


class NotASocket(RuntimeError):
    def __init__(self, path: Path) -> None:
        super().__init__(f"{path} exists and is not a socket; refusing to replace it "
                         "(move it away to start the daemon)")


def listen_private(path: Path) -> socket.socket:
    """A listening unix socket at ``path``, 0600 from its first moment.

    It is bound under a temporary name with a umask that leaves only the owner, then
    renamed over ``path``: no client ever sees a socket others may use, and a stale
    socket file is replaced in one step.
    """
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temp.unlink()
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old_umask = os.umask(0o177)
        try:
            with unixaddr.address(temp) as where:
                listener.bind(where)
        finally:
            os.umask(old_umask)
        os.chmod(temp, 0o600)
        listener.listen(128)
        os.replace(temp, path)
    except BaseException:
        listener.close()
        try:
            temp.unlink()
        except FileNotFoundError:
            pass
        raise
    return listener


def socket_is_live(path: Path) -> bool:
    """True when something accepts connections on the unix socket ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        with unixaddr.address(path) as where:
            probe.connect(where)
    except OSError:
        return False
    finally:
        probe.close()
    return True


def peer_uid(conn: socket.socket) -> int:
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    _pid, uid, _gid = _UCRED.unpack(raw)
    return uid


class KernelTimeouts:
    """Receive and send timeouts kept in the kernel (SO_RCVTIMEO, SO_SNDTIMEO).

    The socket stays in blocking mode, so a request costs one ``recv`` and one
    ``send``: Python's own timeouts would add a ``poll`` before each and two
    ``fcntl`` calls per ``settimeout``, half the system calls of a round trip.
    A timed-out call raises BlockingIOError (EAGAIN). Each option is set only
    when its value changes.
    """

    def __init__(self, sock: socket.socket) -> None:
        sock.settimeout(None)
        self._sock = sock
        self._receive: float | None = None

    def receive(self, seconds: float) -> None:
        if seconds != self._receive:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))
            self._receive = seconds

    def send(self, seconds: float) -> None:
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(seconds))


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    micros = int((seconds - whole) * 1_000_000)
    if whole == 0 and micros == 0:
        micros = 1  # zero would mean "no timeout"
    return struct.pack("ll", whole, micros)


def send_all(sock: socket.socket, data: bytes, timeout_s: float) -> None:
    """``sendall`` bounded by ``timeout_s`` overall, on a socket with SO_SNDTIMEO set.

    One ``send`` in the common case; a client that reads too slowly to take the
    response within the timeout gets TimeoutError.
    """
    started = time.monotonic()
    sent = sock.send(data)
    if sent == len(data):
        return
    view = memoryview(data)[sent:]
    try:
        while view:
            remaining = timeout_s - (time.monotonic() - started)
            if remaining <= 0:
                raise TimeoutError("response not taken in time")
            # Each send may block for the socket's timeout: cut it to what is left.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(remaining))
            view = view[sock.send(view):]
    finally:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(timeout_s))


def shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
