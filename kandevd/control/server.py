"""ControlServer: JSON-RPC 2.0 over the daemon's unix socket (the external intake).

Security and robustness, following supervisor:

* the socket is bound to a temporary name, chmod'ed 0600 and then renamed
  into place, so it is never reachable with looser permissions; its folder
  (the home) is 0700;
* a socket file left by a killed daemon is detected by trying to connect
  to it; a live one is never stolen (:class:`SocketInUse`);
* every connection's peer uid is read with SO_PEERCRED; another uid is
  refused unless it is root;
* errors are codes from a closed set, never a traceback.

Threads: one accept thread and one thread per connection (at most
``max_connections``), all non-daemon and joined by :meth:`close`.

Shutdown is in two steps so the coordinator can order them:
:meth:`begin_drain` makes every method except ``daemon.status`` answer
``shutting_down``, waits for requests already in progress to finish, and
closes the listener; :meth:`close` (after the loops and the runtime have
stopped) closes the remaining connections and joins their threads.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import struct
import threading
from pathlib import Path
from typing import Any

from kandevd.control.protocol import (
    MAX_LINE_BYTES,
    InternalError,
    InvalidRequest,
    RpcError,
    ShuttingDown,
    encode,
    failure,
    parse_request,
    success,
)
from kandevd.control.registry import Registry

log = logging.getLogger("kandevd.control")

_UCRED = struct.Struct("3i")


class SocketInUse(RuntimeError):
    def __init__(self, path: Path) -> None:
        super().__init__(f"another process is serving {path}")


class NotASocket(RuntimeError):
    def __init__(self, path: Path) -> None:
        super().__init__(f"{path} exists and is not a socket; refusing to replace it "
                         "(move it away to start the daemon)")


def socket_is_live(path: Path) -> bool:
    """True when something accepts connections on the unix socket ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def peer_uid(conn: socket.socket) -> int:
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    _pid, uid, _gid = _UCRED.unpack(raw)
    return uid


class ControlServer:
    def __init__(self, path: Path, registry: Registry, *, max_connections: int = 64) -> None:
        self.path = Path(path)
        self.registry = registry
        self.max_connections = max_connections
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._lock = threading.Condition()
        self._connections: dict[threading.Thread, socket.socket] = {}
        self._in_flight = 0
        self._draining = False
        self._closed = False
        self.requests_served = 0

    # -- start ---------------------------------------------------------------
    def start(self) -> None:
        if self.path.exists() or self.path.is_symlink():
            if not stat.S_ISSOCK(self.path.lstat().st_mode):
                raise NotASocket(self.path)
            if socket_is_live(self.path):
                raise SocketInUse(self.path)
            log.info("replacing stale control socket %s", self.path)
        temp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            temp.unlink()
        except FileNotFoundError:
            pass
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            old_umask = os.umask(0o177)
            try:
                listener.bind(str(temp))
            finally:
                os.umask(old_umask)
            os.chmod(temp, 0o600)
            listener.listen(64)
            os.replace(temp, self.path)
        except BaseException:
            listener.close()
            try:
                temp.unlink()
            except FileNotFoundError:
                pass
            raise
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
        """Close every connection and join its thread. Idempotent."""
        with self._lock:
            self._draining = True
            self._closed = True
            connections = dict(self._connections)
        self._close_listener()
        for conn in connections.values():
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in connections:
            thread.join()

    @property
    def draining(self) -> bool:
        return self._draining

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
                return  # listener shut down
            try:
                self._admit(conn)
            except Exception:  # e.g. "can't start new thread": drop this one, keep accepting
                log.exception("could not admit a control connection")
                with self._lock:
                    for thread, sock in list(self._connections.items()):
                        if sock is conn and not thread.is_alive():
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
            self._reject(conn, "connection refused: peer uid is not allowed")
            return
        with self._lock:
            if self._closed:
                conn.close()
                return
            full = len(self._connections) >= self.max_connections
            if not full:
                thread = threading.Thread(target=self._serve, args=(conn,),
                                          name="kandevd-control-conn")
                self._connections[thread] = conn
                # Started under the lock: close() snapshots the connections under it
                # too, and joining a registered-but-unstarted thread would raise.
                thread.start()
        if full:
            self._reject(conn, "too many control connections")

    @staticmethod
    def _reject(conn: socket.socket, message: str) -> None:
        from kandevd.control.protocol import Refused

        try:
            conn.sendall(encode(failure(None, Refused(message))))
        except OSError:
            pass
        conn.close()

    # -- one connection ------------------------------------------------------
    def _serve(self, conn: socket.socket) -> None:
        try:
            reader = conn.makefile("rb", buffering=65536)
            while True:
                try:
                    line = reader.readline(MAX_LINE_BYTES + 1)
                except OSError:
                    return
                if not line:
                    return
                if (len(line) > MAX_LINE_BYTES and not line.endswith(b"\n")) \
                        or len(line) > MAX_LINE_BYTES + 1:
                    self._send(conn, failure(None, InvalidRequest(
                        "invalid request: line exceeds the 1 MiB limit; closing connection")))
                    return
                if not line.strip():
                    continue
                response = self._handle_line(line)
                if response is not None and not self._send(conn, response):
                    return
        finally:
            try:
                conn.close()
            except OSError:
                pass
            with self._lock:
                self._connections.pop(threading.current_thread(), None)

    @staticmethod
    def _send(conn: socket.socket, message: dict[str, Any]) -> bool:
        try:
            conn.sendall(encode(message))
            return True
        except OSError:
            return False

    def _handle_line(self, line: bytes) -> dict[str, Any] | None:
        request_id: Any = None
        try:
            request_id, name, params, notification = parse_request(line)
        except RpcError as exc:
            return failure(exc.extra.pop("id", None), exc)
        try:
            response = success(request_id, self.dispatch(name, params))
        except RpcError as exc:
            response = failure(request_id, exc)
        except Exception:
            log.exception("method %s failed", name)
            response = failure(request_id, InternalError("internal error"))
        return None if notification else response

    def dispatch(self, name: str, params: dict[str, Any]) -> Any:
        """Validate and run one method, honouring the drain."""
        method = self.registry.get(name)
        with self._lock:
            if self._draining and not method.allowed_while_stopping:
                raise ShuttingDown("the daemon is shutting down")
            self._in_flight += 1
        try:
            self.registry.check_params(method, params)
            result = method.handler(params)
            self.requests_served += 1
            return result
        finally:
            with self._lock:
                self._in_flight -= 1
                self._lock.notify_all()
