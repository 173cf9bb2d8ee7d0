"""Fault injection for the reliability tests (``KANDEVD_FAULTS``, JSON).

Some failures cannot be produced on demand from outside the process at the
exact moment that matters: a database write failing while an outcome is
recorded, or a cancel landing between a run's claim and the start of its
agent. ``KANDEVD_FAULTS`` lets a test ask for them::

    {"fail_outcome_writes": 3}       the next 3 outcome writes to the database fail
                                     (as SQLite does when the disk is full)
    {"dispatch_gate": "/path/fifo"}  before starting a claimed run's agent, log
                                     "fault: run <id> waits at the dispatch gate"
                                     and read one line from this FIFO

Unset (always, outside tests) every hook is a no-op. A value that does not
parse is logged and ignored: a test facility must never stop the daemon.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
from collections.abc import Mapping

log = logging.getLogger("kandevd.faults")

ENV = "KANDEVD_FAULTS"


class Faults:
    def __init__(self, fail_outcome_writes: int = 0, dispatch_gate: str | None = None) -> None:
        self._lock = threading.Lock()
        self._fail_outcome_writes = fail_outcome_writes
        self.dispatch_gate = dispatch_gate

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Faults:
        raw = (os.environ if environ is None else environ).get(ENV)
        if not raw:
            return cls()
        try:
            spec = json.loads(raw)
            faults = cls(fail_outcome_writes=int(spec.get("fail_outcome_writes", 0)),
                         dispatch_gate=spec.get("dispatch_gate"))
        except (ValueError, TypeError, AttributeError) as exc:
            log.warning("%s ignored: %s", ENV, exc)
            return cls()
        log.warning("fault injection active: %s", raw)
        return faults

    def outcome_write(self) -> None:
        """Raise like a full disk would, while injected failures remain."""
        with self._lock:
            if self._fail_outcome_writes <= 0:
                return
            self._fail_outcome_writes -= 1
        raise sqlite3.OperationalError("database or disk is full (injected fault)")

    def before_start(self, run_id: str) -> None:
        """Hold a claimed run's dispatch until the gate FIFO yields a line."""
        gate = self.dispatch_gate
        if not gate:
            return
        log.warning("fault: run %s waits at the dispatch gate", run_id)
        with open(gate, encoding="utf-8") as fifo:
            fifo.readline()


NO_FAULTS = Faults()
