"""Gateway: the runners' HTTP server and the watch over silent runners.

cheroot serves it behind the same bounded intake as the console
(:mod:`kandevd.net.httpintake`: whole requests only, headers and bodies
bounded, a slow client holds no thread), with TLS when configured. Its worker
threads outnumber the runners a daemon usually serves, since each waiting poll
holds one (for at most :data:`~kandevd.gateway.protocol.MAX_POLL_WAIT_S`).
:class:`RunnerWatch` is the Loop that ends the executions of runners gone silent.
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime

from cheroot import wsgi

from kandevd.gateway.app import GatewayApp
from kandevd.gateway.remote import RemoteRuns
from kandevd.lifecycle import Loop, StopSignal
from kandevd.net.httpintake import GuardedServer, LazyTlsAdapter, stop_and_join
from kandevd.net.listen import is_loopback

log = logging.getLogger("kandevd.gateway")

#: Worker threads: each waiting poll holds one.
THREADS = 40
#: How often the watch looks for silent runners.
WATCH_S = 1.0


class Gateway:
    """Owns the server thread; ``start`` binds (OSError when it cannot), ``stop`` joins."""

    def __init__(self, address: tuple[str, int], app: GatewayApp, remote: RemoteRuns, *,
                 tls: LazyTlsAdapter | None = None) -> None:
        self.address = address
        self.app = app
        self.remote = remote
        self.tls = tls
        self._server: wsgi.Server | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def port(self) -> int:
        return self._server.bind_addr[1] if self._server is not None else self.address[1]

    @property
    def url(self) -> str:
        host = self.address[0]
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else "[::1]" if host == "::" else \
            f"[{host}]" if ":" in host else host
        return f"{'https' if self.tls else 'http'}://{shown}:{self.port}"

    def start(self) -> None:
        with self._lock:
            if self._server is not None:
                return
            server = GuardedServer(self.address, self.app, numthreads=THREADS,
                                   server_name="kandevd-gateway", timeout=10,
                                   shutdown_timeout=5)
            server.expiration_interval = 30.0
            if self.tls is not None:
                server.ssl_adapter = self.tls
            server.prepare()  # binds now: a port in use fails the start, not a thread
            self._server = server
            self._thread = threading.Thread(target=server.serve, name="kandevd-gateway",
                                            daemon=True)
            self._thread.start()
        if not is_loopback(self.address[0]):
            log.warning("gateway listens on %s, reachable from other machines%s", self.address[0],
                        "" if self.tls else " over plain HTTP (gateway.insecure_remote)")
        log.info("gateway for runners at %s", self.url)

    def hold(self) -> None:
        """The daemon stops: no more work is handed out, runners are still heard (so
        they keep their agents while its own end; see ``Daemon._shutdown_steps``)."""
        self.remote.hold()

    def stop(self) -> None:
        """Stop serving: waiting polls answer at once, then the threads are joined."""
        with self._lock:
            server, thread = self._server, self._thread
            self._server = None
        if server is None:
            return
        self.remote.stop()
        stop_and_join(server, thread, "gateway", log)


class RunnerWatch(Loop):
    """Every second: the claims of runners silent for ``gateway.dead_after_s`` rescued."""

    def __init__(self, remote: RemoteRuns, *, parent: StopSignal | None = None) -> None:
        super().__init__("gateway", parent=parent, logger=log)
        self.remote = remote

    def tick(self, now: datetime) -> float:
        self.remote.watch()
        return WATCH_S
