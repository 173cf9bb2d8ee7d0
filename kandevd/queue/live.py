"""What the queue's rooms share: the runs live here, and the loop's wake-up.

A run is live here from its claim until its outcome is in the database (or
needs none): while it executes, and while a refused outcome write waits to
be tried again. A live run's agent is busy, and stale-claim recovery leaves
it alone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from pathlib import Path

from kandevd.runs.model import Claim
from kandevd.runtime import attempts


class LiveRuns:
    """The runs live here, their attempt folders and cancels; every room locks ``lock``."""

    def __init__(self, attempts_folder: Path) -> None:
        self.lock = threading.Lock()
        self.attempts_folder = attempts_folder
        self.agents: dict[str, str] = {}  # run id -> agent id
        #: (run id, claim token) -> the attempt's folder, when it is not the one
        #: attempt_dir() names (an attempt of the legacy two-level layout).
        self.folders: dict[tuple[str, str], Path] = {}
        self.cancel_requested: set[str] = set()  # claimed runs cancelled, maybe not started

    def run_ids(self) -> frozenset[str]:
        with self.lock:
            return frozenset(self.agents)

    def agent_ids(self) -> frozenset[str]:
        with self.lock:
            return frozenset(self.agents.values())

    def busy_agents(self, ended: Collection[str], leaving: Collection[str]) -> set[str]:
        """Agents of live runs, but those whose execution ``ended`` and left the runtime."""
        with self.lock:
            return {agent for run_id, agent in self.agents.items()
                    if run_id not in ended or run_id in leaving}

    def folder(self, claim: Claim) -> Path:
        """The folder of ``claim``'s attempt: where its execution keeps its record."""
        with self.lock:
            known = self.folders.get((claim.run.id, claim.token))
        return known if known is not None else attempts.attempt_dir(
            self.attempts_folder, claim.run.id, claim.token)


class Waker:
    """The in-process signal: the queue loop's ``wake`` once the loop is built."""

    def __init__(self) -> None:
        self._wake: Callable[[], None] | None = None
        self.enabled = True

    def connect(self, wake: Callable[[], None] | None) -> None:
        self._wake = wake

    def __call__(self) -> None:
        wake = self._wake
        if wake is not None and self.enabled:
            wake()
