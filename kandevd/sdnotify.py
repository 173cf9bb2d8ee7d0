"""systemd's notify protocol (``sd_notify``), spoken directly: no dependency.

Each notification is one datagram of ``KEY=value`` lines sent over an
``AF_UNIX``/``SOCK_DGRAM`` socket to ``$NOTIFY_SOCKET`` (a leading ``@``
means the Linux abstract namespace). Without ``NOTIFY_SOCKET`` (not under
systemd, or ``Type=simple``) every call is a no-op. Nothing here ever raises:
a notification that cannot be sent (the manager went away, a full buffer) is
dropped, it must never disturb the daemon.

What the daemon sends (docs/operations.md, systemd)::

    READY=1 + STATUS=...   once the control socket listens
    STATUS=...             now and then (each safety pass of the queue loop)
    STOPPING=1             when the graceful shutdown starts
    WATCHDOG=1             with WATCHDOG_USEC set, from the queue loop's tick at
                           most every WATCHDOG_USEC/2: a wedged loop stops pinging
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["SystemdNotifier", "queue_status"]


class SystemdNotifier:
    """The daemon's voice to systemd: one per daemon, made by its process from the
    environment and handed to what speaks (the queue loop, the start, the reload)."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        raw = env.get("NOTIFY_SOCKET", "")
        self._address: str | bytes | None = None
        if raw.startswith("@"):
            self._address = b"\0" + raw[1:].encode()
        elif raw.startswith("/"):
            self._address = raw
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.watchdog_interval_s: float | None = None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        try:
            watchdog_s = int(usec) / 1_000_000
        except ValueError:
            watchdog_s = 0.0
        # WATCHDOG_PID, when set, names the process meant to ping (not a child of it).
        if watchdog_s > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_interval_s = watchdog_s / 2
        self._last_ping: float | None = None
        self._ready = False

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def notify(self, *lines: str) -> bool:
        """Send one datagram of ``lines``; False when disabled or it could not be sent."""
        if self._address is None or not lines:
            return False
        data = "\n".join(line.replace("\n", " ") for line in lines).encode("utf-8", "replace")
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                    self._sock.setblocking(False)
                    self._sock.set_inheritable(False)
                self._sock.sendto(data, self._address)
            except OSError:
                self._close_locked()
                return False
        return True

    def ready(self, status: str | None = None) -> bool:
        self._ready = True
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def stopping(self, status: str = "stopping") -> bool:
        return self.notify("STOPPING=1", f"STATUS={status}")

    def status(self, text: str) -> bool:
        """A STATUS= line; dropped before READY=1, so READY=1 is always the first news."""
        if not self._ready:
            return False
        return self.notify(f"STATUS={text}")

    def watchdog(self, now: float | None = None) -> bool:
        """Ping the watchdog if WATCHDOG_USEC is set and half its period has passed."""
        interval = self.watchdog_interval_s
        if interval is None or self._address is None:
            return False
        now = time.monotonic() if now is None else now
        if self._last_ping is not None and now - self._last_ping < interval:
            return False
        self._last_ping = now
        return self.notify("WATCHDOG=1")

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None


def queue_status(queue: Any) -> str | None:
    """``running 1/4 agent(s), 3 run(s) queued`` for a RunQueue; None if it cannot say."""
    try:
        runtime = queue.runtime
        queued = queue.counts().get("queued", 0)
        return (f"running {runtime.running}/{runtime.max_concurrent} agent(s), "
                f"{queued} run(s) queued")
    except Exception:  # a status line is never worth an error
        return None
