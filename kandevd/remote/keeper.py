"""A runner's side of its keeper: the keeper stops the runner's agents by itself when
the runner is gone, or frozen (:mod:`kandevd.keeper.fences`), where a daemon's keeper
keeps them for the next start."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kandevd.keeper import protocol
from kandevd.runtime.keeperclient import KeeperClient

#: The first keeper version that knows ``fence``.
FENCE_VERSION = 3


class RunnerKeeperClient(KeeperClient):
    def __init__(self, home: Path, *, stop_alone_after: float) -> None:
        """``stop_alone_after``: with no runner attached this long, the keeper stops every
        agent; its fence is armed for as long at each attach, until the runner renews it."""
        super().__init__(home)
        self.stop_alone_after = stop_alone_after

    def _hello_extra(self) -> dict[str, Any]:
        return {"stop_alone_after": self.stop_alone_after, "fence": True}

    def fence(self, until: float) -> None:
        """The keeper stops every agent at ``until`` (``time.monotonic()``, one clock for
        every process of the machine) unless told a later one. Never waits: the
        runner's own fence sends it. Not said to a keeper older than the fence, nor
        while none is attached (the reader attaches the next; the next look says it)."""
        if self.state.version < FENCE_VERSION:
            return
        with self._send_lock:
            sock = self._sock
            if sock is None:
                return
            try:
                protocol.send(sock, {"op": "fence", "until": until})
            except OSError:
                pass  # (a keeper that died: its reader starts the next)
