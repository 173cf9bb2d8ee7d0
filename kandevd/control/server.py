"""ControlServer: JSON-RPC 2.0 over the daemon's unix socket (the external intake).

Following supervisor: the socket is bound to a temporary name, chmod'ed 0600
and renamed into place; a live socket is never stolen; every peer's uid is
checked (SO_PEERCRED); errors are codes from a closed set, never a
traceback. One accept thread and one thread per connection, all joined by
:meth:`ControlServer.close`; an idle or slow client is closed, and
``daemon.status``/``daemon.shutdown`` are never refused for lack of
connections (docs/protocol.md, "Connection"). Shutdown is in two steps:
:meth:`ControlServer.begin_drain` (every method but ``daemon.status`` answers
``shutting_down``, requests in progress finish, the listener closes), then
:meth:`ControlServer.close`.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import sqlite3
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kandevd.control.protocol import (
    MAX_LINE_BYTES,
    Conflict,
    InternalError,
    InvalidRequest,
    Refused,
    RpcError,
    ShuttingDown,
    Unavailable,
    encode,
    failure,
    file_unavailable,
    parse_request,
    reject,
    success,
)
from kandevd.control.registry import Registry
from kandevd.control.sockets import (
    KernelTimeouts,
    NotASocket,
    SocketInUse,
    listen_private,
    peer_uid,
    send_all,
    shutdown,
    socket_is_live,
)
from kandevd.control.streaming import LAST_S, Streaming, pump

log = logging.getLogger("kandevd.control")

#: Served even on a connection admitted beyond the cap.
PRIORITY_METHODS = frozenset({"daemon.status", "daemon.shutdown"})
#: Connections subscriptions may never take (events.subscribe is refused beyond).
KEPT_FOR_REQUESTS = 8
#: Upper bound of the send timeout (the idle timeout is used when smaller).
MAX_SEND_TIMEOUT_S = 10.0
_RECV_BYTES = 65536
_MAX_REMEMBERED_DB_ERRORS = 100


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    limited: bool  # admitted beyond the cap: priority methods only
    last_active: float  # time.monotonic() of the connect or of the last request done
    busy: bool = False  # a request is running: never evicted
    evicted: bool = False
    streaming: bool = False  # carries events (events.subscribe): flushed at the close


class ControlServer:
    def __init__(self, path: Path, registry: Registry, *, max_connections: int = 64,
                 idle_timeout_s: float = 60.0, send_timeout_s: float | None = None,
                 reserved_connections: int = 4) -> None:
        if idle_timeout_s <= 0:
            raise ValueError("idle_timeout_s must be positive")
        self.path = Path(path)
        self.registry = registry
        self.max_connections = max_connections
        self.reserved_connections = reserved_connections
        self.idle_timeout_s = float(idle_timeout_s)
        self.send_timeout_s = float(send_timeout_s if send_timeout_s is not None
                                    else min(MAX_SEND_TIMEOUT_S, self.idle_timeout_s))
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._lock = threading.Condition()
        self._connections: dict[threading.Thread, _Connection] = {}
        self._in_flight = 0
        self._draining = False
        self._closed = False
        self._full_logged = False
        self._db_errors_logged: set[str] = set()
        self.requests_served = 0
        self.connections_evicted = 0

    # -- start ---------------------------------------------------------------
    def start(self) -> None:
        if self.path.exists() or self.path.is_symlink():
            if not stat.S_ISSOCK(self.path.lstat().st_mode):
                raise NotASocket(self.path)
            if socket_is_live(self.path):
                raise SocketInUse(self.path)
            log.info("replacing stale control socket %s", self.path)
        listener = listen_private(self.path)
        self._listener = listener
        self._accept_thread = threading.Thread(target=self._accept_loop,
                                               name="kandevd-control-accept")
        self._accept_thread.start()
        log.info("control socket listening on %s", self.path)

    # -- shutdown ------------------------------------------------------------
    def refuse_new_requests(self) -> None:
        """From now on every method but ``daemon.status`` answers ``shutting_down``."""
        with self._lock:
            self._draining = True

    def begin_drain(self) -> None:
        """Refuse new work, let requests in progress finish, close the listener."""
        with self._lock:
            self._draining = True
            while self._in_flight:
                self._lock.wait()
        self._close_listener()

    def _close_listener(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() on Linux
            except OSError:
                pass
            listener.close()
        if self._accept_thread is not None:
            self._accept_thread.join()
            self._accept_thread = None
        try:
            if self.path.exists() and not socket_is_live(self.path):
                self.path.unlink()
        except OSError:
            pass

    def close(self) -> None:
        """Close every connection and join its thread (a subscription's last events go
        out first, for at most a second). Idempotent."""
        with self._lock:
            self._draining = True
            self._closed = True
            connections = dict(self._connections)
        self._close_listener()
        deadline = time.monotonic() + LAST_S + 0.5
        for thread, state in connections.items():
            if state.streaming:
                thread.join(max(0.0, deadline - time.monotonic()))
        for state in connections.values():
            shutdown(state.sock)
        for thread in connections:
            thread.join()

    @property
    def draining(self) -> bool:
        return self._draining

    def connection_count(self) -> int:
        """Open connections (those closed to make room but not yet gone excluded)."""
        with self._lock:
            return sum(not c.evicted for c in self._connections.values())

    # -- accept --------------------------------------------------------------
    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        while True:
            try:
                conn, _ = listener.accept()
            except OSError as exc:
                if exc.errno in (errno.EINTR, errno.ECONNABORTED):
                    continue
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("control socket: cannot accept a connection: %s", exc)
                    time.sleep(0.1)  # out of descriptors: let idle timeouts free some
                    continue
                return  # listener shut down
            try:
                self._admit(conn)
            except Exception:  # e.g. "can't start new thread": drop this one, keep accepting
                log.exception("could not admit a control connection")
                with self._lock:
                    for thread, state in list(self._connections.items()):
                        if state.sock is conn and not thread.is_alive():
                            del self._connections[thread]
                conn.close()

    def _admit(self, conn: socket.socket) -> None:
        try:
            uid = peer_uid(conn)
        except OSError:
            conn.close()
            return
        if uid not in (os.getuid(), 0):
            log.warning("refused control connection from uid %d", uid)
            reject(conn, "connection refused: peer uid is not allowed")
            return
        with self._lock:
            if self._closed:
                conn.close()
                return
            limited = self._make_room()
            if limited is None:
                admitted = False
            else:
                admitted = True
                state = _Connection(conn, limited, time.monotonic())
                thread = threading.Thread(target=self._serve, args=(state,),
                                          name="kandevd-control-conn")
                self._connections[thread] = state
                # Started under the lock: close() snapshots the connections under it
                # too, and joining a registered-but-unstarted thread would raise.
                thread.start()
        if not admitted:
            reject(conn, "too many control connections")

    def _make_room(self) -> bool | None:
        """Under the lock: False (a regular slot), True (a limited one) or None (none).

        At the cap the longest-idle regular connection is closed to make room;
        when all are running a request, a reserved slot (priority methods only)
        is used, closing the longest-idle limited connection if need be.
        """
        live = [c for c in self._connections.values() if not c.evicted]
        regular = [c for c in live if not c.limited]
        if len(regular) < self.max_connections:
            self._full_logged = False
            return False
        if not self._full_logged:
            self._full_logged = True
            log.warning("control socket: %d connections open (the cap); closing the "
                        "longest-idle ones to make room for new clients", len(regular))
        if self._evict_longest_idle(regular):
            return False
        limited = [c for c in live if c.limited]
        if len(limited) < self.reserved_connections or self._evict_longest_idle(limited):
            return True
        return None

    def _evict_longest_idle(self, candidates: list[_Connection]) -> bool:
        idle = [c for c in candidates if not c.busy]
        if not idle:
            return False
        victim = min(idle, key=lambda c: c.last_active)
        victim.evicted = True
        self.connections_evicted += 1
        log.debug("closing a control connection idle for %.1f s to make room",
                  time.monotonic() - victim.last_active)
        shutdown(victim.sock)  # its thread wakes from recv/sendall and exits
        return True

    # -- one connection ------------------------------------------------------
    def _serve(self, state: _Connection) -> None:
        sock = state.sock
        timeout = KernelTimeouts(sock)
        try:
            timeout.send(self.send_timeout_s)
        except OSError:
            shutdown(sock)
            sock.close()
            with self._lock:
                self._connections.pop(threading.current_thread(), None)
            return
        buffer = bytearray()
        scanned = 0  # no newline in buffer[:scanned]
        deadline = time.monotonic() + self.idle_timeout_s
        fresh = True  # nothing read since the idle clock was (re)started
        try:
            while True:
                newline = buffer.find(b"\n", scanned)
                if newline < 0:
                    scanned = len(buffer)
                    if len(buffer) > MAX_LINE_BYTES:
                        self._too_long(state)
                        return
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        self._idle_close(bool(buffer))
                        return
                    try:
                        # Right after a request the kernel timeout is the whole idle time
                        # (set once); after anything that did not restart the idle clock
                        # (an unfinished line, a blank line) it is what is left of it.
                        timeout.receive(self.idle_timeout_s if fresh else remaining)
                        chunk = sock.recv(_RECV_BYTES)
                    except (TimeoutError, BlockingIOError):
                        self._idle_close(bool(buffer))
                        return
                    except OSError:
                        return
                    if not chunk:  # EOF: a last line without its newline is still a line
                        if buffer.strip():
                            self._answer(state, bytes(buffer))
                        return
                    buffer += chunk
                    fresh = False
                    continue
                line = bytes(buffer[:newline + 1])
                del buffer[:newline + 1]
                scanned = 0
                if len(line) > MAX_LINE_BYTES + 1:
                    self._too_long(state)
                    return
                if not line.strip():
                    continue  # a blank line is no request: it does not reset the idle clock
                if not self._answer(state, line):
                    return
                deadline = time.monotonic() + self.idle_timeout_s
                fresh = not buffer
        finally:
            shutdown(sock)
            try:
                sock.close()
            except OSError:
                pass
            with self._lock:
                self._connections.pop(threading.current_thread(), None)

    def _idle_close(self, partial: bool) -> None:
        log.debug("closing a control connection: no complete request in %.1f s%s",
                  self.idle_timeout_s, " (an unfinished line)" if partial else "")

    def _too_long(self, state: _Connection) -> None:
        self._send(state, failure(None, InvalidRequest(
            "invalid request: line exceeds the 1 MiB limit; closing connection")))

    def _answer(self, state: _Connection, line: bytes) -> bool:
        """Handle one request line and send its answer; False: drop the connection."""
        with self._lock:
            if state.evicted:
                return False
            state.busy = True
        try:
            response = self._handle_line(line, limited=state.limited)
        finally:
            with self._lock:
                state.busy = False
                state.last_active = time.monotonic()
        streaming = response.get("result") if response is not None else None
        if isinstance(streaming, Streaming):  # notifications until either side ends:
            with self._lock:  # never idle (nor evicted) meanwhile; then the connection ends
                full = sum(c.streaming for c in self._connections.values()) \
                    >= self.max_connections - KEPT_FOR_REQUESTS
                state.busy = state.streaming = not full
            if full:  # (subscriptions never take the slots other clients' requests need)
                streaming.end()
                return self._send(state, failure(response.get("id"), Refused(
                    "too many subscriptions: every connection but "
                    f"{KEPT_FOR_REQUESTS} carries events; retry later")))
            if self._send(state, {**response, "result": streaming.result}):
                pump(state.sock, streaming, lambda: self._closed or state.evicted)
            streaming.end()
            return False
        return response is None or self._send(state, response)

    def _send(self, state: _Connection, message: dict[str, Any]) -> bool:
        try:
            data = encode(message)
        except (ValueError, TypeError):  # a NaN or a lone surrogate in a result: a bug
            log.exception("a control response is not standard JSON")
            data = encode(failure(message.get("id"), InternalError("internal error")))
        try:
            send_all(state.sock, data, self.send_timeout_s)
            return True
        except (TimeoutError, BlockingIOError):
            log.info("dropping a control connection that does not read its responses "
                     "(nothing read for %.1f s)", self.send_timeout_s)
            return False
        except OSError:
            return False

    def _handle_line(self, line: bytes, *, limited: bool = False) -> dict[str, Any] | None:
        """The response to one line (None for a notification); never raises."""
        request_id: Any = None
        name = "?"
        try:
            try:
                request_id, name, params, notification = parse_request(line)
            except RpcError as exc:
                return failure(exc.extra.pop("id", None), exc)
            try:
                if limited and name not in PRIORITY_METHODS:
                    raise Refused("too many control connections: this one is limited to "
                                  f"{', '.join(sorted(PRIORITY_METHODS))}; retry later")
                result = self.dispatch(name, params)
                if notification and isinstance(result, Streaming):
                    result.end()  # (no answer to carry anything after)
                response = success(request_id, result)
            except RpcError as exc:
                response = failure(request_id, exc)
            return None if notification else response
        except Exception:
            log.exception("method %s failed", name)
            return failure(request_id, InternalError("internal error"))

    def dispatch(self, name: str, params: dict[str, Any]) -> Any:
        """Validate and run one method, honouring the drain."""
        method = self.registry.get(name)
        with self._lock:
            if self._draining and not method.allowed_while_stopping:
                raise ShuttingDown("the daemon is shutting down")
            self._in_flight += 1
        try:
            self.registry.check_params(method, params)
            try:
                with self.registry.reading(method):  # a read never waits for a writer
                    result = method.handler(params)
            except sqlite3.IntegrityError as exc:
                # A constraint the database enforces (one claim per agent, a unique
                # key) lost a race with another writer: the request conflicts.
                raise Conflict(f"the write conflicts with the stored data: {exc}") from None
            except sqlite3.DatabaseError as exc:
                raise self._unavailable(name, exc) from None
            except OSError as exc:  # a file the method needed: a full disk, an I/O error
                refused = file_unavailable(exc)
                log.warning("method %s: %s", name, refused.message)
                raise refused from None
            self.requests_served += 1
            return result
        finally:
            with self._lock:
                self._in_flight -= 1
                self._lock.notify_all()

    def _unavailable(self, name: str, exc: sqlite3.DatabaseError) -> Unavailable:
        reason = str(exc) or type(exc).__name__
        with self._lock:
            first = reason not in self._db_errors_logged
            if first and len(self._db_errors_logged) < _MAX_REMEMBERED_DB_ERRORS:
                self._db_errors_logged.add(reason)
        if first:
            log.error("method %s: database unavailable: %s (%s; logged once per reason)",
                      name, reason, type(exc).__name__)
        return Unavailable(f"database unavailable: {reason}")
