"""``/``: the daemon at a glance: status, queue, what is stuck, the last day as pictures."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from typing import Any

from kandevd.store.runs.activity import Activity, read_activity
from kandevd.web.charts import Series, line_chart
from kandevd.web.context import Console, parse_time
from kandevd.web.http import Request, Response

#: The charts are per minute: reading them again within this many seconds shows the same.
CHART_TTL_S = 20.0
_cache_lock = threading.Lock()
_cache: dict[int, tuple[float, Any, Activity]] = {}


def page(console: Console, request: Request) -> Response:
    return console.render("overview.html", request, title="Overview", nav="overview",
                          **gather(console))


def fragment(console: Console, request: Request) -> Response:
    """The live part of the page (the script swaps it in when something changed)."""
    return console.fragment("overview_live.html", **gather(console))


def gather(console: Console) -> dict[str, Any]:
    now = datetime.now(UTC)
    status = console.call("daemon.status")
    config = console.call("scheduler.config.get")
    claimed = console.call("runs.list", {"status": "claimed", "limit": 100})["items"]
    for run in claimed:
        started = parse_time(run.get("claimed_at"))
        run["running_s"] = (now - started).total_seconds() if started else None
    claimed.sort(key=lambda r: -(r["running_s"] or 0))
    waiting = console.call("runs.list", {"status": "queued", "limit": 10})["items"]
    for run in waiting:
        asked = parse_time(run.get("requested_at"))
        run["waiting_s"] = (now - asked).total_seconds() if asked else None
    activity = _activity(console, now, (status.get("runs") or {}).get("failed"))
    oldest = parse_time((status.get("runs") or {}).get("oldest_queued_at"))
    queued_now = (status.get("runs") or {}).get("queued")
    charts = [
        line_chart("Runs ended per minute", [
            Series("finished", "ok", activity.finished,
                   f"{activity.finished_total} in 24 h"),
            Series("failed", "bad", activity.failed, f"{activity.failed_total} in 24 h")],
            unit="runs per minute"),
        # The legend is the queue as it is now (the series' last minute is approximate).
        line_chart("Queue depth", [Series("queued", "info", activity.queue_depth,
                                          f"{queued_now if queued_now is not None else '—'}"
                                          " now")], unit="runs queued"),
    ]
    return {"status": status, "config": config, "claimed": claimed[:10], "waiting": waiting,
            "oldest_age_s": (now - oldest).total_seconds() if oldest else None,
            "failed_24h": activity.failed_total, "finished_24h": activity.finished_total,
            "charts": charts, "uptime_s": _uptime(status, now)}


def _activity(console: Console, now: datetime, dead_letter: Any) -> Activity:
    """The last day per minute, read again after :data:`CHART_TTL_S`, or at once when
    the dead letter changed (the card shows both: a run just failed for good must not
    stand beside a 24 h failure count without it)."""
    key = id(console)
    with _cache_lock:
        cached = _cache.get(key)
        if cached is not None and time.monotonic() - cached[0] < CHART_TTL_S \
                and cached[1] == dead_letter:
            return cached[2]
    activity = console.reads(lambda store: read_activity(store, now))
    with _cache_lock:
        _cache[key] = (time.monotonic(), dead_letter, activity)
    return activity


def _uptime(status: dict[str, Any], now: datetime) -> float | None:
    started = parse_time(status.get("started_at"))
    return (now - started).total_seconds() if started else None
