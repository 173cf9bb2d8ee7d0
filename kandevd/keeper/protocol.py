"""The keeper's wire: JSON messages over a unix SOCK_SEQPACKET socket, file descriptors
alongside.

A SEQPACKET socket keeps message boundaries, so one ``sendmsg`` is one message
and the descriptors passed with it (``SCM_RIGHTS``) belong to that message and
no other: the daemon hands over an agent's stdin, stdout and log with its
spawn request, the keeper hands back the agent's pidfd with its answer. Every
message is one JSON object; ``op`` names a request (daemon to keeper), ``ev``
an event (keeper to daemon). docs/keeper.md lists them.
"""

from __future__ import annotations

import array
import json
import os
import socket
import threading
from pathlib import Path
from typing import Any

#: 2: ``hello`` carries the daemon's environment, a ``spawn`` only what it changes.
#: 3: a runner's ``fence`` (kandevd.keeper.fences).
VERSION = 3
#: The largest message (a spawn request carries the agent's environment).
MAX_MESSAGE = 256 * 1024
#: At most this many descriptors travel with one message.
MAX_FDS = 4
#: Where a home's keeper lives.
FOLDER = "keeper"
SOCKET = "keeper.sock"
JOURNAL = "journal"
LOCK = "keeper.lock"


# (plain ints: the flags' enum arithmetic costs more than the rest of a receive)
_CLOEXEC = int(socket.MSG_CMSG_CLOEXEC)
_TRUNCATED = int(socket.MSG_TRUNC | socket.MSG_CTRUNC)
_SOL_SOCKET = int(socket.SOL_SOCKET)
_SCM_RIGHTS = int(socket.SCM_RIGHTS)
_FD_BYTES = array.array("i").itemsize
_ANCILLARY = socket.CMSG_SPACE(MAX_FDS * _FD_BYTES)

#: One receive buffer per thread, kept: a fresh buffer of MAX_MESSAGE for each message
#: (what ``socket.recv_fds`` allocates) is an mmap, mremap and munmap every time.
_buffers = threading.local()


class ProtocolError(Exception):
    """A message that is not one (too large, not JSON, not an object)."""


def folder(home: Path) -> Path:
    return Path(home) / FOLDER


def socket_path(home: Path) -> Path:
    return folder(home) / SOCKET


#: One encoder for every message and journal line (``json.dumps`` with options builds
#: an encoder per call).
COMPACT = json.JSONEncoder(separators=(",", ":"))


def encode(message: dict[str, Any]) -> bytes:
    data = COMPACT.encode(message).encode("utf-8")
    if len(data) > MAX_MESSAGE:
        raise ProtocolError(f"message of {len(data)} bytes is over {MAX_MESSAGE}")
    return data


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    """One message (and its descriptors, which stay open here: the caller closes them)."""
    data = encode(message)
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


def receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """The next message and the descriptors that came with it; None at the end.

    Descriptors arrive close-on-exec; a malformed message's are closed before
    ProtocolError is raised, so nothing leaks."""
    view = getattr(_buffers, "view", None)
    if view is None:
        view = _buffers.view = memoryview(bytearray(MAX_MESSAGE + 1))
    size, ancillary, flags, _address = sock.recvmsg_into([view], _ANCILLARY, _CLOEXEC)
    fds = _descriptors(ancillary)
    if not size and not fds:
        return None
    try:
        if flags & _TRUNCATED or size > MAX_MESSAGE:
            raise ProtocolError("message truncated")
        try:
            message = json.loads(bytes(view[:size]))
        except ValueError as exc:
            raise ProtocolError(f"not JSON: {exc}") from None
        if not isinstance(message, dict):
            raise ProtocolError("not a JSON object")
    except ProtocolError:
        close_all(fds)
        raise
    return message, fds


def _descriptors(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors of ``SCM_RIGHTS`` ancillary data (as ``socket.recv_fds`` reads it)."""
    if not ancillary:
        return []
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == _SOL_SOCKET and kind == _SCM_RIGHTS:
            fds.frombytes(data[:len(data) - (len(data) % _FD_BYTES)])
    return list(fds)


def close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
