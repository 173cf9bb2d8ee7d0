"""Office: autonomous work for Office tasks, routines and budgets.

* :mod:`~kandevd.store.office.predicate` - what an Office task is (once, SQL + Python)
* :mod:`~kandevd.office.subscribers` - assignment -> one ``task_assigned`` run
* :mod:`~kandevd.office.recovery` - unstarted Office tasks get their run
* :mod:`~kandevd.office.routines` - cron routines -> ``routine_trigger`` runs
* :mod:`~kandevd.office.budgets` - spend alerts and ``pause_agent``
* :mod:`~kandevd.office.loop` - :class:`OfficeLoop`, the maintenance cadence

Each handler is gated on persisted Office configuration: without it a tick
costs one small existence query per handler and scans nothing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HandlerResult:
    """What one handler tick did: whether it scanned, and how many things it acted on."""

    scanned: bool
    acted: int = 0
