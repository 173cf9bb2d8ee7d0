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
    """The runs live here, their attempt folders and cancels, behind one lock of its own."""

    def __init__(self, attempts_folder: Path) -> None:
        self._lock = threading.Lock()
        self.attempts_folder = attempts_folder
        self._agents: dict[str, str] = {}  # run id -> agent id
        #: (run id, claim token) -> the attempt's folder, when it is not the one
        #: attempt_dir() names (an attempt of the legacy two-level layout).
        self._folders: dict[tuple[str, str], Path] = {}
        self._cancel_requested: set[str] = set()  # claimed runs cancelled, maybe not started

    def begin(self, run_id: str, agent_id: str) -> None:
        """``run_id`` is live here from now on: its agent is busy."""
        with self._lock:
            self._agents[run_id] = agent_id

    def end(self, run_id: str, token: str | None = None) -> None:
        """``run_id`` is live here no more (settled, or never started): what was kept of
        it goes, a cancel of it included."""
        with self._lock:
            self._agents.pop(run_id, None)
            self._cancel_requested.discard(run_id)
            if token is not None:
                self._folders.pop((run_id, token), None)

    def keep_folder(self, run_id: str, token: str, directory: Path) -> None:
        """The attempt's folder is ``directory``, not the one attempt_dir() names."""
        with self._lock:
            self._folders[(run_id, token)] = directory

    def request_cancel(self, run_id: str) -> None:
        """A claimed run was cancelled: a dispatch that has not started it yet stops it."""
        with self._lock:
            self._cancel_requested.add(run_id)

    def cancel_requested(self, run_id: str) -> bool:
        with self._lock:
            return run_id in self._cancel_requested

    def forget_cancel_unless_live(self, run_id: str) -> None:
        """The run was requested again: no old cancel applies, unless the cancelled attempt
        is still live here (being dispatched or stopped), whose flag must still stop it."""
        with self._lock:
            if run_id not in self._agents:
                self._cancel_requested.discard(run_id)

    def run_ids(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._agents)

    def agent_ids(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._agents.values())

    def busy_agents(self, ended: Collection[str], leaving: Collection[str]) -> set[str]:
        """Agents of live runs, but those whose execution ``ended`` and left the runtime."""
        with self._lock:
            return {agent for run_id, agent in self._agents.items()
                    if run_id not in ended or run_id in leaving}

    def folder(self, claim: Claim) -> Path:
        """The folder of ``claim``'s attempt: where its execution keeps its record."""
        with self._lock:
            known = self._folders.get((claim.run.id, claim.token))
        return known if known is not None else attempts.attempt_dir(
            self.attempts_folder, claim.run.id, claim.token)


class Waker:
    """The in-process signal: what wakes the queue loop (by default it sets
    :attr:`event`, the loop's wake-up); ``enabled`` False holds it back (a benchmark's
    preload). Made by the composition root before the runtime, whose freed slots call
    it, and the queue, which signals with it."""

    def __init__(self, wake: Callable[[], None] | None = None) -> None:
        """``wake``: what a signal calls instead of setting :attr:`event` (tests)."""
        #: The queue loop's wake-up (the loop is built with it).
        self.event = threading.Event()
        self._wake = wake if wake is not None else self.event.set
        self.enabled = True

    def __call__(self) -> None:
        if self.enabled:
            self._wake()
