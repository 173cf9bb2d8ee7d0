"""A TCP proxy between a daemon and PostgreSQL that can cut the network and heal it.

``cut()`` stops forwarding both ways without closing anything (packets of an open
connection go unanswered, a new connection is accepted but never reaches the
server), as a network partition does; ``heal()`` resumes: what was held back is
delivered. The upstream is PostgreSQL's unix socket (pgserver listens on none but
that) or a TCP address.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

CHUNK = 65536


class PartitionProxy:
    def __init__(self, upstream: str | tuple[str, int]) -> None:
        self.upstream = upstream
        self.flowing = threading.Event()
        self.flowing.set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="proxy-accept").start()

    def url(self, database_url: str) -> str:
        """``database_url`` (pgserver's) pointed at this proxy over TCP."""
        database = database_url.split("?", 1)[0].rsplit("/", 1)[1]
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def cut(self) -> None:
        self.flowing.clear()

    def heal(self) -> None:
        self.flowing.set()

    def close(self) -> None:
        self._closed = True
        self.flowing.set()
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                try:
                    sock.close()
                except OSError:
                    pass

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        self.flowing.wait()  # a connection made during a cut reaches nothing until healed
        try:
            if isinstance(self.upstream, tuple):
                server = socket.create_connection(self.upstream)
            else:
                server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                server.connect(self.upstream)
        except OSError:
            client.close()
            return
        with self._lock:
            self._sockets += [client, server]
        for src, dst in ((client, server), (server, client)):
            threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                self.flowing.wait()
                data = src.recv(CHUNK)
                if not data:
                    break
                self.flowing.wait()  # read during a cut: held back until healed
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def pg_socket(server: Any) -> str:
    """The unix socket of a pgserver PostgreSQL."""
    uri = server.get_uri()
    folder = Path(uri.split("host=", 1)[1].split("&", 1)[0])
    [path] = [p for p in folder.glob(".s.PGSQL.*") if not p.name.endswith(".lock")]
    return str(path)
