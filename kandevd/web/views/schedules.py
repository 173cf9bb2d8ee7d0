"""``/schedules``: every job (with its workflow's label), a timeline of the coming day,
the global pause. One job and its runs are :mod:`kandevd.web.views.job`'s.

The global pause is ``scheduler.config.put``; it confirms what it did on the next page.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote, urlencode

from kandevd.control.registry import MAX_OFFSET
from kandevd.cron import parse_cron
from kandevd.web.charts import Lane, timeline
from kandevd.web.context import Console, parse_time, set_flash
from kandevd.web.http import Request, Response, redirect

PAGE = 50
#: Jobs drawn on the timeline (the soonest first); more would not be readable.
TIMELINE_LANES = 40
#: More fires than this in a lane are drawn as a band ("more than 48 fires").
TIMELINE_FIRES = 48
#: Jobs listed on one page (scheduler.jobs.list answers 500 at most per call).
PAGE_JOBS = 200
STATES = ("running", "scheduled", "buffered", "held", "paused", "disabled", "blocked",
          "invalid", "ended")


def job_url(job: dict[str, Any], suffix: str = "") -> str:
    url = "/schedules/" + quote(str(job["id"]), safe=":@") + suffix
    if job.get("user_id"):
        url += "?" + urlencode({"user": job["user_id"]})
    return url


def job_params(job: str, request: Request) -> dict[str, Any]:
    params: dict[str, Any] = {"id": job}
    user = request.query.get("user") or request.form.get("user") \
        if request.method == "POST" else request.query.get("user")
    if user:
        params["user_id"] = user
    return params


def index(console: Console, request: Request) -> Response:
    params: dict[str, Any] = {"limit": 500}
    state = request.query.get("state")
    if state in STATES:
        params["state"] = state
    kind = request.query.get("kind")
    if kind in ("workflow", "product"):
        params["entity_type"] = kind
    ignored = " ".join(
        f"There is no {what} {value!r}: jobs of every {what} are shown."
        for what, value, known in (("state", state, STATES),
                                   ("kind", kind, ("workflow", "product")))
        if value and value not in known) or None
    offset = _int(request.query.get("offset"))
    everyone = all_jobs(console, params)  # the timeline picks the soonest of all
    config = console.call("scheduler.config.get")
    return console.render("schedules.html", request, title="Schedules", nav="schedules",
                          jobs=everyone[offset:offset + PAGE_JOBS], total=len(everyone),
                          offset=offset, limit=PAGE_JOBS, config=config, states=STATES,
                          state=state, kind=kind, job_url=job_url, timeline=_timeline(everyone),
                          ignored=ignored)


def all_jobs(console: Console, params: dict[str, Any]) -> list[dict[str, Any]]:
    jobs: list[dict[str, Any]] = []
    while True:
        page = console.call("scheduler.jobs.list", {**params, "offset": len(jobs)})
        jobs += page["items"]
        if not page["items"] or len(jobs) >= page["total"]:
            return jobs


def _timeline(jobs: list[dict[str, Any]]) -> Any:
    now = datetime.now(UTC)
    end = now + timedelta(hours=24)
    span = (end - now).total_seconds()
    lanes = []
    upcoming = sorted((j for j in jobs if parse_time(j.get("next_run_at"))),
                      key=lambda j: parse_time(j["next_run_at"]) or end)
    for job in upcoming[:TIMELINE_LANES]:
        first = parse_time(job["next_run_at"])
        if first is None or first > end:
            continue
        fires = [first]
        if job.get("cron_expression") and job.get("state") in ("scheduled", "running"):
            try:
                trigger = parse_cron(job["cron_expression"], job.get("timezone") or "UTC")
            except Exception:  # (a job in state invalid has no next fire anyway)
                trigger = None
            moment = first
            while trigger is not None and len(fires) <= TIMELINE_FIRES:
                moment = trigger.get_next_fire_time(moment, moment + timedelta(microseconds=1))
                if moment is None or moment > end:
                    break
                fires.append(moment)
        dense = TIMELINE_FIRES if len(fires) > TIMELINE_FIRES else 0
        label = job.get("name") or job["id"]
        if job.get("user_id"):
            label += f" ({job['user_id']})"
        lanes.append(Lane(label, job_url(job),
                          [(f - now).total_seconds() / span for f in fires], dense))
    return timeline(lanes) if lanes else None


def pause(console: Console, request: Request) -> Response:
    form = request.form
    paused = form.get("paused") == "yes"
    params: dict[str, Any] = {"globally_paused": paused}
    note = form.get("note", "").strip()
    if paused and note:
        params["paused_by"] = note
    console.call("scheduler.config.put", params)
    message = f"Scheduler paused ({note})" if paused and note else \
        "Scheduler paused" if paused else "Scheduler resumed"
    return set_flash(console, redirect("/schedules"), "ok", message)


def _int(value: str | None) -> int:
    """A page's offset from its query: 0 when it is not a whole number, at most the
    largest offset the daemon takes."""
    try:
        return min(max(0, int(value or 0)), MAX_OFFSET)
    except ValueError:
        return 0
