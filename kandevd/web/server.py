"""WebConsole: the console's thread-pool HTTP server, started just before the control
socket and stopped with the intake at shutdown (live streams end, the threads are joined).

cheroot (CherryPy's WSGI server) serves it: a fixed pool of worker threads made
for blocking WSGI code such as ours, started and stopped from another thread,
and nothing polled while nobody connects (its connection manager waits in
``select`` up to :data:`IDLE_WAKE_S`). :mod:`kandevd.net.httpintake` keeps clients
that have not signed in from holding a thread or much memory; with
``web.tls_cert``/``tls_key`` it serves HTTPS.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cheroot import wsgi

from kandevd.events.hub import EventHub, Subscription
from kandevd.net.httpintake import GuardedServer, LazyTlsAdapter, stop_and_join
from kandevd.net.listen import is_loopback
from kandevd.web.app import ConsoleApp
from kandevd.web.auth import Guard, ensure_token
from kandevd.web.context import Console, Dispatch

log = logging.getLogger("kandevd.web")

THREADS = 12
#: How long the idle server sleeps between looks at its kept-alive connections.
IDLE_WAKE_S = 30.0


def console_url(host: str, port: int, token: str | None, path: str = "/", *,
                tls: bool = False) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else "[::1]" if host == "::" else \
        f"[{host}]" if ":" in host else host
    scheme = "https" if tls else "http"
    return f"{scheme}://{shown}:{port}{path}" + (f"?token={token}" if token else "")


class Subscribers:
    """The live views' subscriptions to the daemon's events: the same hub, topics and
    buffers as ``events.subscribe`` (one mechanism). The console's stop ends them."""

    def __init__(self, hub: EventHub) -> None:
        self.hub = hub
        self._lock = threading.Lock()
        self._open: set[Subscription] = set()

    def subscribe(self, patterns: Sequence[str]) -> Subscription:
        subscription = self.hub.subscribe(patterns)
        with self._lock:
            self._open.add(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        self.hub.unsubscribe(subscription)
        with self._lock:
            self._open.discard(subscription)

    def close(self) -> None:
        with self._lock:
            every, self._open = list(self._open), set()
        for subscription in every:
            self.hub.unsubscribe(subscription)


class WebConsole:
    """Owns the server thread; ``start`` binds (OSError when it cannot), ``stop`` joins."""

    def __init__(self, address: tuple[str, int], *, home: Path, dispatch: Dispatch,
                 reads: Callable[[Callable[[Any], Any]], Any], version: str,
                 events: EventHub,
                 workflow_root: Path, allowed_hosts: tuple[str, ...] = (),
                 tls: LazyTlsAdapter | None = None) -> None:
        self.address = address
        self.home = Path(home)
        self.token = ensure_token(self.home)
        self.stopping = threading.Event()
        self.subscribers = Subscribers(events)
        self.tls = tls
        self._parts = dict(dispatch=dispatch, reads=reads, version=version,
                           workflow_root=workflow_root, allowed_hosts=allowed_hosts)
        self.console: Console | None = None
        self._server: wsgi.Server | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        port = self._server.bind_addr[1] if self._server is not None else self.address[1]
        return console_url(self.address[0], port, self.token, tls=self.tls is not None)

    @property
    def port(self) -> int:
        return self._server.bind_addr[1] if self._server is not None else self.address[1]

    def start(self) -> None:
        """Bind and serve (OSError when the port is taken)."""
        with self._lock:
            if self._server is not None:
                return
            server = GuardedServer(self.address, None, numthreads=THREADS,
                                   server_name="kandevd", timeout=10, shutdown_timeout=5)
            server.expiration_interval = IDLE_WAKE_S
            if self.tls is not None:
                server.ssl_adapter = self.tls
            server.prepare()  # binds now: a port in use fails the start, not a thread
            # The cookie is named for the port, known once bound (port 0: any free one).
            parts = self._parts
            self.console = Console(
                dispatch=parts["dispatch"], reads=parts["reads"],
                guard=Guard(self.token, self.address[0], parts["allowed_hosts"],
                            port=server.bind_addr[1], secure=self.tls is not None),
                stopping=self.stopping, version=parts["version"],
                subscribe=self.subscribers.subscribe,
                unsubscribe=self.subscribers.unsubscribe,
                workflow_root=parts["workflow_root"], home=self.home)
            server.wsgi_app = ConsoleApp(self.console)
            self._server = server
            self._thread = threading.Thread(target=server.serve, name="kandevd-web",
                                            daemon=True)
            self._thread.start()
        if not is_loopback(self.address[0]):
            log.warning("web console listens on %s, reachable from other machines%s: anyone "
                        "who has its token can act on this daemon", self.address[0],
                        "" if self.tls else " over plain HTTP (web.insecure_remote)")

    def stop(self) -> None:
        """Stop serving: live streams end, then the server's threads are joined."""
        with self._lock:
            server, thread = self._server, self._thread
            self._server = None
        if server is None:
            return
        self.stopping.set()
        self.subscribers.close()
        stop_and_join(server, thread, "web console", log)
