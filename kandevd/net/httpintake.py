"""How a request reaches an HTTP server of the daemon (the console, the gateway): whole,
in memory, before a worker thread takes it.

cheroot reads a request in a worker thread with blocking reads, each bounded by
its timeout but the request as a whole by nothing, and by default with no limit
on headers or body. Behind a port that anyone on the machine (or the network)
can reach, twelve clients trickling a byte every few seconds would hold every
worker, and one large body would be read into memory after its 401. So here:

- :class:`GuardedConnection` gathers each request with non-blocking reads (the
  worker returns the connection to cheroot's selector between them, so a slow
  client holds no thread) until its headers and its ``Content-Length`` body
  are all here, then hands the bytes to cheroot's parser. A request whose
  length cannot be told for sure (two lengths, ``+100``) is answered 400 here:
  cheroot would pick a length and wait for the body in a worker. Headers over
  :data:`MAX_HEADER`, a body over :data:`MAX_BODY` (answered 413 by cheroot,
  unread) and a request not whole within :data:`REQUEST_DEADLINE_S` end the
  connection; at most :data:`MAX_GATHERING` connections may be gathering at
  once, the oldest making room for a new one. An anonymous client so costs at
  most one bounded buffer and never a worker.
- :class:`ClosingGateway` keeps a connection open after an answer only when the
  request was signed in (the application says so in its environ); every other
  answer closes it, unread body and all.
- :class:`LazyTlsAdapter`: the TLS handshake happens in the gathering reads, not
  in cheroot's accepting thread (where a client that never finishes it would
  stall every other connection).
"""

from __future__ import annotations

import io
import logging
import socket
import ssl
import threading
import time
from collections import OrderedDict
from typing import Any

from cheroot import makefile, wsgi
from cheroot import server as cheroot_server
from cheroot.ssl.builtin import BuiltinSSLAdapter

log = logging.getLogger("kandevd.net.http")

#: The largest request body read (a form, a runner's report or log chunk).
MAX_BODY = 256 * 1024
#: Request line and headers together; a browser's with its cookies fit many times over.
MAX_HEADER = 32 * 1024
#: From a request's first byte (or its connection's accept) until it is all here.
REQUEST_DEADLINE_S = 10.0
#: Connections whose request is not yet whole; the oldest goes when one more comes.
MAX_GATHERING = 64
#: The environ key by which the application keeps a connection open (a signed-in request).
KEEP_ALIVE = "kandevd.keep_alive"

_RECV = 64 * 1024
_WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError,
                ssl.SSLWantWriteError)


class Gathering:
    """The connections of one server whose request is not whole yet, oldest first."""

    def __init__(self, limit: int = MAX_GATHERING) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._started: OrderedDict[GuardedConnection, float] = OrderedDict()

    def begin(self, conn: GuardedConnection, started: float) -> None:
        """``conn`` waits for more of its request; past the limit the oldest is ended."""
        with self._lock:
            self._started[conn] = started
            evicted = []
            while len(self._started) > self.limit:
                evicted.append(self._started.popitem(last=False)[0])
        for old in evicted:
            old.end_gathering()

    def done(self, conn: GuardedConnection) -> None:
        with self._lock:
            self._started.pop(conn, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._started)


class _Replay(io.RawIOBase):
    """The bytes already gathered, then the socket: what cheroot's parser reads."""

    def __init__(self, data: bytes, sock: socket.socket) -> None:
        self._data = memoryview(data)
        self._socket = socket.SocketIO(sock, "rb")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        if self._data:
            size = min(len(buffer), len(self._data))
            buffer[:size] = self._data[:size]
            self._data = self._data[size:]
            return size
        return self._socket.readinto(buffer)

    def take(self) -> bytes:
        rest, self._data = bytes(self._data), memoryview(b"")
        return rest

    def pending(self) -> bool:
        return bool(self._data)

    def close(self) -> None:
        self._socket.close()
        super().close()


class _ReplayReader(makefile.StreamReader):
    """cheroot's socket reader over a :class:`_Replay`."""

    def __init__(self, data: bytes, sock: socket.socket, bufsize: int) -> None:
        super(makefile.StreamReader, self).__init__(_Replay(data, sock), bufsize)
        self.bytes_read = 0

    def has_data(self) -> bool:
        return super().has_data() or self.raw.pending()

    def take_unread(self) -> bytes:
        """What the parser left (a pipelined next request), taken out of this reader."""
        buffered = b""
        if super().has_data():
            buffered = self.read(len(self.peek(0)))
        return buffered + self.raw.take()


class BadFraming(ValueError):
    """A request whose length cannot be told for sure: refused here, whoever sent it."""


def request_size(data: bytes) -> int | None:
    """How many bytes the request at the start of ``data`` has, once its headers are here
    (None before). A request cheroot refuses at its headers (a body too large) counts as
    whole there: cheroot answers it without reading on; so does a chunked one (the
    applications refuse it, 411, without reading its body). BadFraming when the headers
    are not plainly ``name: value`` lines, or hold two ``Content-Length`` or ``Host``
    headers, or a length that is not plain digits: cheroot would read them its own way
    (the last length, a name with spaces around it) and wait for a body that never comes
    in a worker thread (RFC 9112 asks for a 400)."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = end + 4
    fields = _fields(bytes(data[data.find(b"\r\n") + 2:end]))  # (a bytearray's slices
    # cannot be keys)
    if len(fields.get(b"host", ())) > 1:
        raise BadFraming("more than one Host header")
    lengths = fields.get(b"content-length", [])
    if len(lengths) > 1:
        raise BadFraming("more than one Content-Length header")
    if b"transfer-encoding" in fields or not lengths:
        return head
    if not (lengths[0].isascii() and lengths[0].isdigit()):
        raise BadFraming("a Content-Length that is not a number of bytes")
    length = int(lengths[0])
    return head if length > MAX_BODY else head + length


def _fields(block: bytes) -> dict[bytes, list[bytes]]:
    """The header lines as cheroot reads them (the name stripped and in any case, the
    value stripped), by lower-case name; BadFraming for a line that is not one."""
    fields: dict[bytes, list[bytes]] = {}
    for line in block.split(b"\r\n") if block else ():
        name, colon, value = line.partition(b":")
        if not colon or line[:1] in (b" ", b"\t") or not name.strip():
            raise BadFraming("a header line that is not 'name: value'")
        fields.setdefault(name.strip().lower(), []).append(value.strip())
    return fields


class GuardedConnection(cheroot_server.HTTPConnection):
    """A connection whose requests are gathered whole before cheroot parses them."""

    server: GuardedServer

    def __init__(self, server_: Any, sock: socket.socket, makefile_: Any = makefile.MakeFile
                 ) -> None:
        super().__init__(server_, sock, makefile_)
        self._buffer = bytearray()
        self._started: float | None = time.monotonic()  # (the first request: from accept)
        self._refused: str | None = None  # (why the request is answered 400 here)

    def communicate(self) -> bool:
        """One step: gather without blocking, and answer once the request is whole.
        True keeps the connection (cheroot's selector wakes it when more comes)."""
        state = self._gather()
        if state == "more":
            return True
        self.server.gathering.done(self)
        if state == "gone":
            return False
        if self._refused is not None:
            self._refuse(self._refused)
            return False
        data, self._buffer = bytes(self._buffer), bytearray()
        self._started = None
        old, self.rfile = self.rfile, _ReplayReader(data, self.socket, self.rbufsize)
        old.close()
        return super().communicate()

    def end_gathering(self) -> None:
        """Made to give way (the oldest past the limit): the selector sees the socket end,
        and the next step closes it."""
        try:
            self.socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _gather(self) -> str:
        if isinstance(self.rfile, _ReplayReader) and self.rfile.has_data():
            self._buffer += self.rfile.take_unread()  # a pipelined request
        if self._started is None:
            self._started = time.monotonic()
        ended = False
        try:
            self.socket.setblocking(False)
            while self._wants_more():
                try:
                    chunk = self.socket.recv(_RECV)
                except _WOULD_BLOCK:
                    break
                if not chunk:
                    ended = True
                    break
                self._buffer += chunk
            self.socket.settimeout(self.server.timeout)
        except OSError:  # (a TLS error too: plain HTTP on the HTTPS port; a reset)
            return "gone"
        if not self._wants_more():
            return "whole"
        if ended or time.monotonic() - self._started > REQUEST_DEADLINE_S:
            return "gone"
        self.server.gathering.begin(self, self._started)
        return "more"

    def _refuse(self, why: str) -> None:
        """Answer 400 and close (the answer is small: the socket's buffer takes it)."""
        body = f"Bad Request: {why}\n".encode()
        try:
            self.socket.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\n"
                                b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                                % (len(body), body))
        except OSError:
            pass
        log.debug("HTTP request refused: %s", why)  # (anyone may send these: no flood)

    def _wants_more(self) -> bool:
        """Is the request short of its headers (up to the limit) or of its body?"""
        try:
            size = request_size(self._buffer)
        except BadFraming as exc:
            self._refused = str(exc)
            return False
        if size is None:
            return len(self._buffer) <= MAX_HEADER
        return len(self._buffer) < size


class ClosingGateway(wsgi.Gateway_10):
    """Keeps a connection only after a signed-in request (see :data:`KEEP_ALIVE`)."""

    def start_response(self, status: str, headers: Any, exc_info: Any = None) -> Any:
        write = super().start_response(status, headers, exc_info)
        if not self.env.get(KEEP_ALIVE) or self.req.chunked_read \
                or getattr(self.req.rfile, "remaining", 0):
            self.req.close_connection = True
        return write


class LazyTlsAdapter(BuiltinSSLAdapter):
    """cheroot's TLS adapter, with the handshake left to the first (gathering) read."""

    def wrap(self, sock: socket.socket) -> tuple[ssl.SSLSocket, dict[str, str]]:
        wrapped = self.context.wrap_socket(sock, server_side=True,
                                           do_handshake_on_connect=False)
        return wrapped, {"wsgi.url_scheme": "https", "HTTPS": "on"}


def tls_adapter(cert: str, key: str) -> LazyTlsAdapter:
    """The adapter for ``cert``/``key`` (PEM); ssl.SSLError or OSError when unusable."""
    adapter = LazyTlsAdapter(cert, key)
    adapter.context.minimum_version = ssl.TLSVersion.TLSv1_2
    return adapter


class GuardedServer(wsgi.Server):
    """cheroot's WSGI server with the defences above."""

    ConnectionClass = GuardedConnection
    max_request_header_size = MAX_HEADER
    max_request_body_size = MAX_BODY

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gateway = ClosingGateway
        #: The connections whose request is not whole yet.
        self.gathering = Gathering()


def stop_promptly(server: wsgi.Server) -> None:
    """cheroot's ``stop()`` waits for its selector loop to notice the stop, which sleeps
    up to its expiration interval while nobody connects: stop it from a helper thread
    and connect until that stop has returned, so the loop wakes now (cheroot's public
    API only)."""
    done = threading.Event()
    failure: list[BaseException] = []

    def stop() -> None:
        try:
            server.stop()
        except BaseException as exc:  # raised again in the caller's thread
            failure.append(exc)
        finally:
            done.set()

    stopper = threading.Thread(target=stop, name="kandevd-http-stop", daemon=True)
    stopper.start()
    host, port = server.bind_addr[:2]
    host = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
    # Until the selector noticed: once cheroot closed its socket, there is none to wake.
    while not done.wait(0.05) and server.socket is not None:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                pass
        except OSError:
            pass  # (the loop then notices at its next wake-up)
    stopper.join()
    if failure:
        raise failure[0]


def stop_and_join(server: wsgi.Server, thread: threading.Thread | None, what: str,
                  logger: logging.Logger) -> None:
    """Stop ``server`` at once (:func:`stop_promptly`) and join its serving thread (10 s
    at most: said in ``logger`` if it is still alive), then say ``<what> stopped``."""
    stop_promptly(server)
    if thread is not None:
        thread.join(timeout=10)
        if thread.is_alive():
            logger.warning("%s: its server thread did not end within 10 s", what)
    logger.info("%s stopped", what)
