"""Late fires: what no leader could fire while leadership moved between daemons.

Several daemons on one database let only the leader fire cron occurrences, each
once (its ``(job, intended time)`` row in ``fires``). When a leader is cut off,
its lease expires and another daemon takes over; occurrences that fell due in
between have no row. The new leader fires them now, each once (the same row),
late, with its ``intended_at`` and ``late_s`` on the history entry, one after
another per job (as a backfill runs, but recorded ``trigger_source: cron``).
Only workflow jobs (cron expressions) have occurrences to replay; a product
job's next run is decided from its state and comes at its next tick.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta

from kandevd.schedules.catchup.backfill import BackfillRunning, Backfills
from kandevd.schedules.jobs import Job
from kandevd.schedules.registry import JobRegistry
from kandevd.timeutil import rfc3339

log = logging.getLogger("kandevd.scheduler")

#: The most late occurrences of one job fired after one takeover.
MAX_LATE_PER_JOB = 20


def fire_late(registry: JobRegistry, backfills: Backfills, since: datetime, now: datetime,
              *, gate: Callable[[str, datetime], bool],
              may_run: Callable[[Job], bool]) -> list[float]:
    """Fire the occurrences in ``[since, now]`` that have no fire yet; their lateness
    in seconds (one per occurrence fired). ``may_run(job)``: the fire policy allows a
    run now (not paused, not switched off)."""
    lateness: list[float] = []
    for job in registry.jobs():
        if getattr(job.spec.schedule, "cron_expression", None) is None:
            continue
        if not job.enabled or job.state.invalid is not None or not may_run(job):
            continue
        if backfills.running(job.key):  # (its rows would be written, its fires not run)
            log.warning("%s: occurrences no leader fired are not looked for: a backfill of "
                        "the job is running", job.key)
            continue
        times = [t for t in job.source.next_times(job, since - timedelta(microseconds=1),
                                                  MAX_LATE_PER_JOB) if t <= now]
        owed = [t for t in times if gate(job.key, t)]  # (inserting the row: once)
        if not owed:
            continue
        try:
            backfills.start(job, owed, trigger_source="cron")
        except BackfillRunning:
            log.warning("%s: %d occurrence(s) no leader fired are not run: a backfill of "
                        "the job is running", job.key, len(owed))
            continue
        late = [(now - t).total_seconds() for t in owed]
        lateness += late
        log.warning("%s: %d occurrence(s) fell due while no leader could fire (from %s): "
                    "fired now, late by up to %.1fs", job.key, len(owed), rfc3339(owed[0]),
                    max(late))
    return lateness
