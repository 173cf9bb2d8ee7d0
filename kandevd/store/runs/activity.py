"""What the runs table says about the last day, minute by minute (the console's charts).

Read from the runs themselves (no new table): runs finished and failed per
minute from their end time, and the queue's depth walked back from now with
the runs requested and the runs that left the queue (claimed, or ended
without a claim) in each minute. A run re-queued for a retry keeps its first
``requested_at`` and its latest ``claimed_at``, so the depth is approximate
for retried runs; the counts of ends are exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from kandevd.timeutil import rfc3339


@dataclass(frozen=True)
class Activity:
    """Per-minute series over ``[start, start + minutes)`` (index 0 is the oldest)."""

    start: datetime
    minutes: int
    finished: list[int]
    failed: list[int]
    queue_depth: list[int]

    @property
    def failed_total(self) -> int:
        return sum(self.failed)

    @property
    def finished_total(self) -> int:
        return sum(self.finished)


def queued_by_agent(store: Any) -> dict[str, int]:
    """How many runs each agent has queued (one query for every agent)."""
    return {agent: int(count) for agent, count in store.query(
        "SELECT agent_id, COUNT(*) FROM runs WHERE status = 'queued' GROUP BY agent_id")}


def minute_key(moment: datetime) -> str:
    """``YYYY-MM-DDTHH:MM``: how the stored RFC 3339 times start."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M")


def read_activity(store: Any, now: datetime, minutes: int = 1440) -> Activity:
    """The last ``minutes`` minutes up to ``now`` (the current minute included)."""
    end = now.astimezone(UTC).replace(second=0, microsecond=0) + timedelta(minutes=1)
    start = end - timedelta(minutes=minutes)
    since = rfc3339(start)
    index = {minute_key(start + timedelta(minutes=i)): i for i in range(minutes)}
    finished, failed = [0] * minutes, [0] * minutes
    # The terminal index (COALESCE(finished_at, updated_at)) serves the last day only.
    for minute, done, broke in store.query(
            "SELECT substr(COALESCE(finished_at, updated_at), 1, 16),"
            " SUM(CASE WHEN status = 'finished' THEN 1 ELSE 0 END),"
            " SUM(CASE WHEN status = 'failed' THEN 1 ELSE 0 END)"
            " FROM runs WHERE status IN ('finished', 'failed', 'cancelled')"
            " AND COALESCE(finished_at, updated_at) >= ? GROUP BY 1", (since,)):
        i = index.get(minute)
        if i is not None:
            finished[i], failed[i] = int(done or 0), int(broke or 0)
    arrived, left = [0] * minutes, [0] * minutes
    for minute, count in store.query(
            "SELECT substr(requested_at, 1, 16), COUNT(*) FROM runs"
            " WHERE requested_at >= ? GROUP BY 1", (since,)):
        i = index.get(minute)
        if i is not None:
            arrived[i] = int(count)
    for minute, count in store.query(
            "SELECT substr(COALESCE(claimed_at, finished_at), 1, 16), COUNT(*) FROM runs"
            " WHERE COALESCE(claimed_at, finished_at) >= ? AND requested_at < ?"
            " GROUP BY 1", (since, rfc3339(end))):
        i = index.get(minute)
        if i is not None:
            left[i] = int(count)
    row = store.query_one("SELECT COUNT(*) FROM runs WHERE status = 'queued'")
    depth = int(row[0]) if row else 0
    series = [0] * minutes
    for i in range(minutes - 1, -1, -1):  # the depth at the end of each minute
        series[i] = max(0, depth)
        depth = depth - arrived[i] + left[i]
    return Activity(start, minutes, finished, failed, series)
