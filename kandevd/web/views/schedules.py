"""``/schedules``: every job, a timeline of the coming day, one job, one run drilled into.

Actions (trigger, stop, enable, disable, backfill, the global pause) are the
``scheduler.*`` control methods; each confirms what it did on the next page.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote, urlencode

from kandevd.cron import parse_cron
from kandevd.web.charts import Lane, timeline
from kandevd.web.context import Console, parse_time, set_flash
from kandevd.web.http import Request, Response, redirect
from kandevd.web.logs import readable_log

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
    offset = _int(request.query.get("offset"))
    everyone = all_jobs(console, params)  # the timeline picks the soonest of all
    config = console.call("scheduler.config.get")
    return console.render("schedules.html", request, title="Schedules", nav="schedules",
                          jobs=everyone[offset:offset + PAGE_JOBS], total=len(everyone),
                          offset=offset, limit=PAGE_JOBS, config=config, states=STATES,
                          state=state, kind=kind, job_url=job_url, timeline=_timeline(everyone))


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


def job(console: Console, request: Request, job: str) -> Response:
    params = job_params(job, request)
    found = console.call("scheduler.jobs.get", params)
    offset = _int(request.query.get("offset"))
    history = console.call("scheduler.jobs.runs", {**params, "limit": 20, "offset": offset})
    upcoming: list[dict[str, Any]] = []
    if found.get("cron_expression") or found.get("entity_type") == "workflow":
        try:
            upcoming = console.call("scheduler.jobs.next", {**params, "count": 10})["times"]
        except Exception:  # an invalid job has none; its state says why
            upcoming = []
    definition = {k: found.get(k) for k in DEFINITION_KEYS if found.get(k) not in (None, [], {})}
    return console.render("job.html", request, title=found.get("name") or found["id"],
                          nav="schedules", job=found, definition=definition,
                          upcoming=upcoming, history=history, offset=offset,
                          job_url=job_url, preview=None)


DEFINITION_KEYS = ("id", "entity_type", "workflow", "product", "user_id", "schedule_id",
                   "name", "description", "cron_expression", "timezone", "cadence_hours",
                   "preferred_hour", "quiet_minutes", "enabled", "group_ids", "mode",
                   "messages", "workshop_mode", "trigger_payload", "overlap_policy", "pulse",
                   "notify", "pause_after_failures", "catchup_window_s", "timeout_s",
                   "jitter_s", "start_at", "end_at")


def act(console: Console, request: Request, job: str, action: str) -> Response:
    params = job_params(job, request)
    result = console.call(f"scheduler.jobs.{action}", params)
    found = {"id": job, "user_id": params.get("user_id")}
    message = {
        "trigger": f"Triggered {job}: session {result.get('session_id')}",
        "stop": f"Stop requested for {job} (session {result.get('session_id')})",
        "enable": f"Enabled {job}",
        "disable": f"Disabled {job}",
    }[action]
    return set_flash(console, redirect(job_url(found)), "ok", message)


def backfill(console: Console, request: Request, job: str) -> Response:
    """A dry run first (the page lists the fire times); the real one on confirmation."""
    params = job_params(job, request)
    form = request.form
    body = {**params, "from": _utc(form.get("from", "")), "to": _utc(form.get("to", "")),
            "dry_run": form.get("confirm") != "yes"}
    result = console.call("scheduler.jobs.backfill", body)
    if body["dry_run"]:
        found = console.call("scheduler.jobs.get", params)
        history = console.call("scheduler.jobs.runs", {**params, "limit": 20})
        upcoming = []
        try:
            upcoming = console.call("scheduler.jobs.next", {**params, "count": 10})["times"]
        except Exception:
            upcoming = []
        definition = {k: found.get(k) for k in DEFINITION_KEYS
                      if found.get(k) not in (None, [], {})}
        return console.render("job.html", request, title=found.get("name") or found["id"],
                              nav="schedules", job=found, definition=definition,
                              upcoming=upcoming, history=history, offset=0, job_url=job_url,
                              preview={"from": body["from"], "to": body["to"],
                                       "result": result})
    count = len(result.get("fire_times") or result.get("times") or [])
    back = job_url({"id": job, "user_id": params.get("user_id")})
    return set_flash(console, redirect(back), "ok",
                     f"Backfill of {job} started: {count} fire time(s), one after another")


def _utc(value: str) -> str:
    """RFC 3339 as typed; ``YYYY-MM-DDTHH:MM`` (no zone) is taken as UTC, as the form says."""
    value = value.strip()
    if value and len(value) == 16 and "T" in value:  # 2026-12-01T09:00 from the picker
        return value + ":00Z"
    return value


def entry(console: Console, request: Request, job: str, entry: str) -> Response:
    params = job_params(job, request)
    found = console.call("scheduler.jobs.get", params)
    record = _find_entry(console, params, entry)
    if record is None:
        return console.render("error.html", request, http_status=404, title="Not found",
                              message=f"Job {job} has no run {entry}.")
    turns = []
    for turn in record.get("turns") or []:
        if not isinstance(turn, dict):
            continue
        turns.append({**turn, "log_text": readable_log(console, turn.get("log_path"))})
    return console.render("entry.html", request, title=f"Run {entry[:8]} of {job}",
                          nav="schedules", job=found, entry=record, turns=turns,
                          job_url=job_url)


def _find_entry(console: Console, params: dict[str, Any], entry_id: str
                ) -> dict[str, Any] | None:
    offset = 0
    while True:
        page = console.call("scheduler.jobs.runs", {**params, "limit": 500, "offset": offset})
        for item in page["items"]:
            if item.get("id") == entry_id or item.get("session_id") == entry_id:
                return item
        offset += len(page["items"])
        if not page["items"] or offset >= page["total"]:
            return None


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
    try:
        return max(0, int(value or 0))
    except ValueError:
        return 0
