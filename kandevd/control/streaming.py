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
from collections.abc import Callable
from typing import Any, Protocol

#: How long one wait for events lasts before the socket is looked at again.
WAIT_S = 0.5


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
    """Send ``streaming``'s lines on ``sock`` until either side ends it."""
    pending = b""
    try:
        while not closing() and not streaming.feed.closed:
            if not pending:
                pending = b"".join(streaming.feed.take(WAIT_S))
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
