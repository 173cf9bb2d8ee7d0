"""A control connection that carries notifications after its method's answer
(``events.subscribe``): what the method returns, and the loop that sends them.

The loop never blocks the daemon: it takes what the subscription buffered,
sends it as the socket accepts it (``select``; a client that does not read
just leaves its bytes waiting while its subscription's buffer fills and
counts what it loses), and ends when the client closes the connection or
the server closes it.
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Callable
from typing import Any, Protocol

#: How long one wait for events lasts before the socket is looked at again.
WAIT_S = 0.5
#: After a batch is sent, the next is gathered for 2 ms per line of the last one, from
#: GATHER_MIN_S to GATHER_MAX_S: a lone event still goes out at once, and a daemon that
#: publishes thousands a second wakes each subscriber's thread about 5 times a second
#: (fifty subscribers' threads woken for every event would cost the drain a third).
GATHER_PER_LINE_S = 0.002
GATHER_MIN_S = 0.02
GATHER_MAX_S = 0.2
#: When the server closes, what a subscription buffered goes out within this long.
LAST_S = 1.0


class Feed(Protocol):
    closed: bool

    def take(self, timeout: float) -> list[bytes]: ...


class Streaming:
    """A method's answer after which its connection carries ``feed``'s lines;
    ``end()`` is called once when the connection ends (or if it never streams)."""

    def __init__(self, result: dict[str, Any], feed: Feed, end: Callable[[], None]) -> None:
        self.result = result
        self.feed = feed
        self._end = end
        self._ended = False

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self._end()


def pump(sock: socket.socket, streaming: Streaming, closing: Callable[[], bool]) -> None:
    """Send ``streaming``'s lines on ``sock`` until either side ends it; when the server
    closes, what is buffered still goes out (for at most :data:`LAST_S`)."""
    pending = b""
    sent_at = gather = 0.0
    try:
        while not streaming.feed.closed:
            if closing():
                _last(sock, pending + b"".join(streaming.feed.take(0)))
                return
            if not pending:
                gathering = sent_at + gather - time.monotonic()
                if gathering > 0:
                    time.sleep(gathering)
                lines = streaming.feed.take(WAIT_S)
                pending = b"".join(lines)
                sent_at = time.monotonic() if pending else 0.0
                gather = min(GATHER_MAX_S, max(GATHER_MIN_S, GATHER_PER_LINE_S * len(lines)))
            readable, writable, _ = select.select(
                [sock], [sock] if pending else [], [], WAIT_S if pending else 0)
            if readable and not sock.recv(65536):
                return  # the client closed its end (what it sends is not read)
            if writable:
                sent = sock.send(pending)
                pending = pending[sent:]
    except (OSError, ValueError):
        return  # the connection broke, or was shut down by the server's close
    finally:
        streaming.end()


def _last(sock: socket.socket, data: bytes) -> None:
    """Send ``data`` within :data:`LAST_S` (a client that does not read loses it)."""
    deadline = time.monotonic() + LAST_S
    while data and time.monotonic() < deadline:
        _, writable, _ = select.select([], [sock], [], max(0.0, deadline - time.monotonic()))
        if writable:
            data = data[sock.send(data):]
